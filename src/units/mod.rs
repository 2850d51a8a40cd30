//! Each run a transient systemd service (`runner = "systemd"`): started
//! through systemd's D-Bus API (zbus, the `StartTransientUnit` call
//! `systemd-run` makes), named `cronlease-<job>-<fence>.service`, with the
//! job's user, limits, sandbox and credentials as unit properties
//! ([`crate::config::Isolation`]). Its stdout and stderr are pipes the
//! daemon reads, as for a process: the output tail, the scrubbing and the
//! log stay the same.
//!
//! The daemon follows each unit through one subscription for all of them
//! (systemd's `PropertiesChanged` signals under its unit objects, routed to
//! the run they belong to): no polling. A unit is started with `AddRef`, so
//! systemd keeps it after it ended until the daemon read how it ended
//! (result, exit status, CPU time, peak memory) and let it go. Stopping one
//! (timeout, lease lost, shutdown) is `KillUnit` SIGTERM to all its
//! processes, SIGKILL after the grace; whatever the main process leaves
//! behind is SIGKILLed by systemd when it exits (`KillSignal=SIGKILL`).
//!
//! Each unit is also given to the job guard ([`crate::guard`]): if the
//! daemon dies, the guard kills the daemon's units and waits for them to be
//! gone before it records the runs `killed` and hands the leases over, as
//! for processes. The second line of defence is the daemon's unit's
//! `ExecStopPost=` (`cronlease __wait-guard`): once daemon and guard are
//! gone it kills whatever run unit of theirs is left ([`sweep`]; their
//! Description names the daemon's unit). Not `BindsTo=`: a stop of the
//! daemon's unit would stop the runs with it at once, where a graceful stop
//! gives them `shutdown_grace` to finish.

//!
//! Behind the cargo feature `systemd` (a default one), which brings zbus. A
//! build without it has the process runner only: `runner = "systemd"` is
//! refused at start (exit 78), `auto` picks processes, and there are no
//! units to kill or sweep. `__unit-run` ([`tee`]) needs no D-Bus and is
//! always there.

pub mod tee;

#[cfg(feature = "systemd")]
mod runner;
#[cfg(feature = "systemd")]
pub use runner::*;

#[cfg(not(feature = "systemd"))]
mod without {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::config::{Config, RunnerChoice};
    use crate::exec::Runner;

    /// Why the systemd runner cannot be used.
    #[derive(Debug, thiserror::Error)]
    pub enum UnitsError {
        #[error("not built in: this cronlease was built without the `systemd` feature")]
        NotBuilt,
    }

    /// The process runner, unless `runner = "systemd"` asks for what this
    /// build lacks.
    pub async fn choose(config: &Config) -> Result<Arc<dyn Runner>, UnitsError> {
        match config.runner {
            RunnerChoice::Systemd => Err(UnitsError::NotBuilt),
            RunnerChoice::Auto | RunnerChoice::Process => {
                Ok(Arc::new(crate::exec::ProcessRunner::with_cgroups()))
            }
        }
    }

    /// No units without the runner: nothing to kill.
    pub fn kill_and_wait(_units: &std::collections::BTreeSet<String>, _limit: Duration) -> bool {
        true
    }

    /// No units without the runner: nothing to sweep.
    pub fn sweep(_limit: Duration) -> Result<usize, String> {
        Ok(0)
    }
}
#[cfg(not(feature = "systemd"))]
pub use without::*;
