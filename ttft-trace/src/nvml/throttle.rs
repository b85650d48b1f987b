//! Clock-throttle ("clocks event") reasons: NVML's bit mask decoded to stable names.
//!
//! Bit values are NVML's `nvmlClocksThrottleReason*` / `nvmlClocksEventReason*` constants
//! (nvml.h); the names are the snake_case form used as the `reason` label of
//! `ttft_trace_gpu_throttle_active` and in the JSONL.

use serde::Serialize;

/// A set of clock-throttle reasons, as NVML's raw 64-bit mask.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ThrottleReasons(pub u64);

/// Every reason ttft-trace names, in bit order: (bit, name).
pub const REASONS: &[(u64, &str)] = &[
    (0x0000_0001, "gpu_idle"),
    (0x0000_0002, "applications_clocks_setting"),
    (0x0000_0004, "sw_power_cap"),
    (0x0000_0008, "hw_slowdown"),
    (0x0000_0010, "sync_boost"),
    (0x0000_0020, "sw_thermal_slowdown"),
    (0x0000_0040, "hw_thermal_slowdown"),
    (0x0000_0080, "hw_power_brake_slowdown"),
    (0x0000_0100, "display_clock_setting"),
];

impl ThrottleReasons {
    pub const NONE: ThrottleReasons = ThrottleReasons(0);
    pub const GPU_IDLE: ThrottleReasons = ThrottleReasons(0x1);
    pub const APPLICATIONS_CLOCKS_SETTING: ThrottleReasons = ThrottleReasons(0x2);
    pub const SW_POWER_CAP: ThrottleReasons = ThrottleReasons(0x4);
    pub const HW_SLOWDOWN: ThrottleReasons = ThrottleReasons(0x8);
    pub const SYNC_BOOST: ThrottleReasons = ThrottleReasons(0x10);
    pub const SW_THERMAL_SLOWDOWN: ThrottleReasons = ThrottleReasons(0x20);
    pub const HW_THERMAL_SLOWDOWN: ThrottleReasons = ThrottleReasons(0x40);
    pub const HW_POWER_BRAKE_SLOWDOWN: ThrottleReasons = ThrottleReasons(0x80);
    pub const DISPLAY_CLOCK_SETTING: ThrottleReasons = ThrottleReasons(0x100);

    /// Mask of all named bits.
    pub const KNOWN_BITS: u64 = 0x1ff;

    pub fn bits(self) -> u64 {
        self.0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn contains(self, other: ThrottleReasons) -> bool {
        self.0 & other.0 == other.0
    }

    pub fn union(self, other: ThrottleReasons) -> ThrottleReasons {
        ThrottleReasons(self.0 | other.0)
    }

    /// Whether the reason with this name is set (false for an unknown name).
    pub fn has(self, name: &str) -> bool {
        REASONS
            .iter()
            .any(|&(bit, n)| n == name && self.0 & bit != 0)
    }

    /// Names of the set bits, in bit order. Bits NVML may add later are named `bit_<n>`.
    pub fn names(self) -> Vec<String> {
        let mut out: Vec<String> = REASONS
            .iter()
            .filter(|&&(bit, _)| self.0 & bit != 0)
            .map(|&(_, name)| name.to_string())
            .collect();
        let mut unknown = self.0 & !Self::KNOWN_BITS;
        while unknown != 0 {
            let bit = unknown.trailing_zeros();
            out.push(format!("bit_{bit}"));
            unknown &= unknown - 1;
        }
        out
    }

    /// Whether any reason other than `gpu_idle` (an idle GPU lowers its clocks by design) is set.
    pub fn is_slowdown(self) -> bool {
        self.0 & !Self::GPU_IDLE.0 != 0
    }
}

impl Serialize for ThrottleReasons {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.names())
    }
}

impl std::fmt::Display for ThrottleReasons {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0 == 0 {
            return f.write_str("none");
        }
        f.write_str(&self.names().join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_each_bit_to_its_name() {
        for &(bit, name) in REASONS {
            let r = ThrottleReasons(bit);
            assert_eq!(r.names(), vec![name.to_string()]);
            assert!(r.has(name));
        }
        assert_eq!(
            ThrottleReasons::SW_THERMAL_SLOWDOWN.names(),
            vec!["sw_thermal_slowdown"]
        );
        assert_eq!(ThrottleReasons(0x20).bits(), 0x20);
    }

    #[test]
    fn decodes_combinations_and_unknown_bits() {
        let r = ThrottleReasons(0x1 | 0x4 | 0x40 | (1 << 12));
        assert_eq!(
            r.names(),
            vec!["gpu_idle", "sw_power_cap", "hw_thermal_slowdown", "bit_12"]
        );
        assert_eq!(
            r.to_string(),
            "gpu_idle,sw_power_cap,hw_thermal_slowdown,bit_12"
        );
        assert!(r.contains(ThrottleReasons::SW_POWER_CAP));
        assert!(!r.contains(ThrottleReasons::SYNC_BOOST));
        assert!(!r.has("no_such_reason"));
        assert_eq!(ThrottleReasons::NONE.to_string(), "none");
        assert!(ThrottleReasons::NONE.names().is_empty());
    }

    #[test]
    fn idle_alone_is_not_a_slowdown() {
        assert!(!ThrottleReasons::GPU_IDLE.is_slowdown());
        assert!(
            ThrottleReasons::GPU_IDLE
                .union(ThrottleReasons::HW_SLOWDOWN)
                .is_slowdown()
        );
        assert!(!ThrottleReasons::NONE.is_slowdown());
    }

    #[test]
    fn bit_values_match_nvml_wrapper() {
        use nvml_wrapper::bitmasks::device::ThrottleReasons as W;
        assert_eq!(W::GPU_IDLE.bits(), ThrottleReasons::GPU_IDLE.bits());
        assert_eq!(
            W::APPLICATIONS_CLOCKS_SETTING.bits(),
            ThrottleReasons::APPLICATIONS_CLOCKS_SETTING.bits()
        );
        assert_eq!(W::SW_POWER_CAP.bits(), ThrottleReasons::SW_POWER_CAP.bits());
        assert_eq!(W::HW_SLOWDOWN.bits(), ThrottleReasons::HW_SLOWDOWN.bits());
        assert_eq!(W::SYNC_BOOST.bits(), ThrottleReasons::SYNC_BOOST.bits());
        assert_eq!(
            W::SW_THERMAL_SLOWDOWN.bits(),
            ThrottleReasons::SW_THERMAL_SLOWDOWN.bits()
        );
        assert_eq!(
            W::HW_THERMAL_SLOWDOWN.bits(),
            ThrottleReasons::HW_THERMAL_SLOWDOWN.bits()
        );
        assert_eq!(
            W::HW_POWER_BRAKE_SLOWDOWN.bits(),
            ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN.bits()
        );
        assert_eq!(
            W::DISPLAY_CLOCK_SETTING.bits(),
            ThrottleReasons::DISPLAY_CLOCK_SETTING.bits()
        );
    }
}
