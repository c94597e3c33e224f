//! The engine's view of a step plan (`--device metal`, `metal-emulated`):
//! whether one runs the step, and the device-memory traffic it measures for
//! `bench --profile`.

use super::Engine;
use crate::runner::plan::Traffic;

impl Engine {
    /// Whether a plan of our GPU kernels runs the step (`--device metal`,
    /// `metal-emulated`) rather than candle's ops.
    pub fn runs_plan(&mut self) -> bool {
        self.runner.plan_mut().is_some()
    }

    /// Starts or stops measuring the step plan's device-memory traffic
    /// (`bench --profile`); false without a plan that can count.
    pub fn count_plan_traffic(&mut self, on: bool) -> bool {
        self.runner.plan_mut().is_some_and(|p| p.count_traffic(on))
    }

    /// The last step's device-memory traffic, while counting.
    pub fn last_plan_traffic(&mut self) -> Option<Traffic> {
        self.runner.plan_mut().and_then(|p| p.last_traffic())
    }
}
