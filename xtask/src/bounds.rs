//! Each cost and scale figure the README states, with its two limits:
//! - a **guard**, which `bench --quick` enforces in CI: far enough above
//!   the figure that one short round on a 2-core VM stays under it, close
//!   enough that a real regression (a program that runs for untraced tasks,
//!   a second trap per launch, a table that grows per event) breaks it;
//! - a **goal**, what the project aims at, reported by the full bench as met
//!   or not. A missed goal never fails a run, and never hides a broken guard.
//!
//! Every bench part returns its [`Verdicts`]; the bench prints them and
//! fails when a guard is broken.

/// The two limits of one figure (higher is worse).
#[derive(Clone, Copy)]
pub struct Bound {
    pub guard: f64,
    pub goal: f64,
}

/// What an untraced process pays per operation under the tracer, as the
/// paired median ratio to untraced (README: nothing measurable, +2.5 to
/// +7.5 % on a loopback TCP round trip): a program that ran its full path
/// for untraced tasks costs +20 % or more on TCP.
pub const HOST_TAX: Bound = Bound {
    guard: 1.15,
    goal: 1.05,
};

/// A traced launch's added time over one empty uprobe's, measured in the
/// same run (docs/costs.md: 1.34 to 1.52 x, rounds of a million launches
/// 1.30 to 1.67 x on 2026-12-07; CI's 1.89 x of that day had rounds of
/// 200 000 timed while the runtime's probes were still being detached): a
/// second trap per launch is 2.4 x.
pub const LAUNCH: Bound = Bound {
    guard: 1.8,
    goal: 1.10,
};

/// Attach (probes on the real runtime) and detach (exit after SIGINT), in
/// ms (README: 177 to 200 ms, and 8 to 11 ms). The guard was 1 000 ms until
/// 2026-12-07, when the same build measured a median of 995 ms at one hour
/// and 1 152-1 187 ms an hour later on the idle machine, and the build
/// before it 912-1 121 ms: within this VM's drift, not a regression of
/// either (interleaved, their probes loaded in 855-973 ms alike). 1 300 ms
/// still catches the regressions this guard has caught (1.4 s to 2.3 s);
/// attach itself has grown from 0.4 s (2026-12-06) to about 1 s: the
/// goal, not the guard, is what is missed (docs/costs.md). 1 400 ms since
/// the header blocks' capture (928a063: medians 1 127 and 1 131 ms, runs up
/// to 1 286 ms, against 1 015 ms the hour before): the drift's margin kept;
/// the one-read-per-step capture it replaced took 3.9 s, and is caught.
pub const ATTACH_MS: Bound = Bound {
    guard: 1400.0,
    goal: 300.0,
};

/// What a neighbour (a process outside the traced tree mapping the same
/// libraries) pays per launch, in ns added to the same launch without a
/// tracer (README: nothing, 28 ns as without): one uprobe trap is about
/// 500 ns here, so the guard is half of one; the goal is +5 % of the launch.
pub fn neighbour_added_ns(untraced_ns: f64) -> Bound {
    Bound {
        guard: 250.0,
        goal: untraced_ns * (HOST_TAX.goal - 1.0),
    }
}

/// The tracer's peak RSS at scale, in KiB (README: 58.5 MiB at 10 000
/// streaming connections).
pub const SCALE_RSS_KIB: Bound = Bound {
    guard: 64.0 * 1024.0,
    goal: 64.0 * 1024.0,
};

/// The tracer's memory per followed connection, in bytes (README: 3.3 KB):
/// twice it is a table entry that doubled.
pub const BYTES_PER_CONNECTION: Bound = Bound {
    guard: 6600.0,
    goal: 3500.0,
};

/// The guards broken and the goals missed or met by one bench run.
#[derive(Default)]
pub struct Verdicts {
    broken: Vec<String>,
    missed: Vec<String>,
    met: Vec<String>,
}

impl Verdicts {
    /// Judges `value` against `bound`; `say(limit)` says what the figure is
    /// and against which limit. A NaN (nothing measured) breaks the guard.
    pub fn judge(&mut self, value: f64, bound: Bound, say: impl Fn(f64) -> String) {
        if value.is_nan() || value > bound.guard {
            self.broken.push(say(bound.guard));
        } else if value > bound.goal {
            self.missed.push(say(bound.goal));
        } else {
            self.met.push(say(bound.goal));
        }
    }

    /// A check that has no goal apart from holding (every request traced,
    /// every connection held): always a guard.
    pub fn require(&mut self, held: bool, what: impl FnOnce() -> String) {
        if !held {
            self.broken.push(what());
        }
    }

    pub fn extend(&mut self, other: Verdicts) {
        self.broken.extend(other.broken);
        self.missed.extend(other.missed);
        self.met.extend(other.met);
    }

    /// The guards broken, for the results file.
    pub fn broken(&self) -> &[String] {
        &self.broken
    }

    /// Prints the verdicts (goals only when `goals`); true when every
    /// guard holds.
    pub fn print(&self, goals: bool) -> bool {
        if goals {
            for m in &self.met {
                println!("goal met: {m}");
            }
            for m in &self.missed {
                println!("goal not met: {m}");
            }
        }
        for b in &self.broken {
            println!("FAIL (guard): {b}");
        }
        if self.broken.is_empty() {
            println!("every guard holds");
        }
        self.broken.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_figure_over_its_guard_breaks_it_and_one_over_its_goal_only_misses() {
        let mut v = Verdicts::default();
        v.judge(1.3, LAUNCH, |l| format!("1.3 x (limit {l})"));
        assert!(v.broken().is_empty());
        assert_eq!(v.missed, ["1.3 x (limit 1.1)"]);
        v.judge(1.05, LAUNCH, |l| format!("1.05 x (limit {l})"));
        assert_eq!(v.met.len(), 1);
        v.judge(f64::NAN, LAUNCH, |_| "nothing measured".into());
        v.judge(1.9, LAUNCH, |l| format!("1.9 x (limit {l})"));
        assert_eq!(v.broken(), ["nothing measured", "1.9 x (limit 1.8)"]);
        v.require(true, || unreachable!());
        v.require(false, || "2 events lost".into());
        assert_eq!(v.broken().len(), 3);
        assert!(!v.print(true));
    }
}
