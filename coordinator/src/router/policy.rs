//! The routing policies by name, and what each of them compares: the
//! candidates (one file per policy beside this one).

use common::WorkerId;

use super::ledger::WorkerLoad;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Policy {
    RoundRobin,
    LeastLoad,
    PowerOfTwo,
    #[default]
    PrefixAware,
}

impl Policy {
    pub const ALL: [Policy; 4] = [Policy::RoundRobin, Policy::LeastLoad, Policy::PowerOfTwo, Policy::PrefixAware];

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastLoad => "least_load",
            Policy::PowerOfTwo => "power_of_two",
            Policy::PrefixAware => "prefix_aware",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Policy::ALL.into_iter().find(|p| p.as_str() == s).ok_or_else(|| {
            format!("unknown policy {s:?} (one of: round_robin, least_load, power_of_two, prefix_aware)")
        })
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A worker the request may go to, as the policies see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub worker: WorkerId,
    /// Leading blocks of the prompt the worker holds in its prefix cache
    /// (either tier).
    pub cached_blocks: usize,
    /// How many of those only its second tier holds: each is copied back.
    pub restore_blocks: usize,
    pub load: WorkerLoad,
}
