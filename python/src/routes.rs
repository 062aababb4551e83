//! The control routes `phub.admin` calls, from phub-proto's route table
//! (`proto/src/routes.rs`), so that the Python client spells no path of
//! its own. Private to the package (`phub._native._control_route`).

use phub_proto::routes::{ControlRoute, Route};
use pyo3::prelude::*;

use crate::errors::UsageError;

/// `(method, path)` of the control route `name` (`admit`, `jobs`, `job`,
/// `evict`) for job `job` where the route names one.
#[pyfunction]
#[pyo3(name = "_control_route", signature = (name, job = None))]
pub(crate) fn control_route(name: &str, job: Option<u64>) -> PyResult<(String, String)> {
    let job = || -> PyResult<u16> {
        let j = job.ok_or_else(|| UsageError::new_err(format!("route `{name}` names a job: give its id")))?;
        u16::try_from(j).map_err(|_| UsageError::new_err(format!("job id {j}: want 0..=65535")))
    };
    let route = match name {
        "admit" => ControlRoute::Admit,
        "jobs" => ControlRoute::Jobs,
        "job" => ControlRoute::Job { job: job()? },
        "evict" => ControlRoute::Evict { job: job()? },
        other => {
            return Err(UsageError::new_err(format!(
                "route `{other}`: want admit, jobs, job or evict"
            )))
        }
    };
    Ok((route.method().as_str().to_string(), route.path()))
}
