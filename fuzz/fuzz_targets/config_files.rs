//! The settings file (TOML) and the attribution thresholds (JSON), as an
//! operator may get them wrong: a clear error, never a panic.

#![no_main]

use libfuzzer_sys::fuzz_target;
use ttft_trace::{causes::CauseConfig, config::DaemonConfig};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(cfg) = toml::from_str::<DaemonConfig>(text) {
        let _ = cfg.listen_addr();
        let _ = cfg.filters();
    }
    let _ = serde_json::from_str::<CauseConfig>(text);
});
