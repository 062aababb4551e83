//! Fetching a replicated job's epoch from control, off the I/O thread
//! (PROTOCOL.md §11.6).
//!
//! Layer: I/O helper of the I/O thread ([`crate::io`]). When the transport
//! asks for an epoch ([`crate::transport::Transport::poll_epoch`]: an
//! appliance named a newer one, or chunks went unanswered), the I/O thread
//! hands the question to [`EpochFetch::ask`], which runs
//! `GET /v1/jobs/{id}/epoch` on a helper thread, again and again, until
//! control serves the epoch wanted or a later one, for
//! [`EPOCH_WAIT`] at most. The I/O thread never blocks on it: it takes the
//! answer with [`EpochFetch::poll`] on a later turn of its loop.
//!
//! Invariants: at most one fetch runs at a time; a question asked while
//! one runs is kept (the highest epoch wanted) and asked when it ends.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TryRecvError};
use phub_http::{Controls, Timeouts};
use phub_proto::failover::EpochView;
use phub_proto::routes::Route;

use crate::error::WorkerError;

/// How long control is asked for an epoch before the worker gives up on
/// it. Control persists a new epoch before it installs it on any
/// appliance, so an appliance naming an epoch means control serves it
/// already; the wait covers control restarting or being slow.
pub(crate) const EPOCH_WAIT: Duration = Duration::from_secs(10);
/// The pause between two questions to control within one fetch.
const RETRY: Duration = Duration::from_millis(20);
/// The HTTP timeout of one question.
const HTTP_TIMEOUT: Duration = Duration::from_secs(2);

/// A fetch's outcome.
#[derive(Debug)]
pub(crate) enum Fetched {
    /// Control serves this epoch (at least the one wanted).
    View(EpochView),
    /// Control did not serve the epoch wanted within the wait.
    Failed {
        /// The epoch wanted.
        wanted: u32,
        /// The epoch the worker held when it asked.
        held: u32,
        /// How long control was asked.
        waited: Duration,
        /// Control's last answer, or why there was none.
        message: String,
        /// Control answered that the job failed (409): nothing will
        /// change it, the requests end with `message`.
        job_failed: bool,
    },
}

/// Fetches of one job's epoch from control.
#[derive(Debug)]
pub(crate) struct EpochFetch {
    /// The control, or controls separated by commas, asked for the
    /// job's epoch; `None` when the worker was made without a control URL
    /// ([`crate::Worker::from_join`]).
    control: Option<String>,
    /// Control's epoch route, for messages.
    url: Option<String>,
    job: u16,
    /// The fetch running, if any.
    running: Option<Receiver<Fetched>>,
    /// Asked while a fetch ran: (wanted, held).
    next: Option<(u32, u32)>,
}

impl EpochFetch {
    /// Fetches of `job`'s epoch from control at `control_url` (one URL, or
    /// several separated by commas; none: every fetch fails at once,
    /// saying so).
    pub(crate) fn new(control_url: Option<&str>, job: u16) -> EpochFetch {
        let path = phub_proto::routes::control::epoch(job).route.path();
        let url = control_url.map(|c| match c.contains(',') {
            false => format!("{}{path}", c.trim().trim_end_matches('/')),
            true => format!("{path} at {c}"),
        });
        EpochFetch {
            control: control_url.map(str::to_string),
            url,
            job,
            running: None,
            next: None,
        }
    }

    /// Control's epoch route, for messages.
    pub(crate) fn url(&self) -> &str {
        self.url
            .as_deref()
            .unwrap_or("(none: the worker was made from a join answer, without control's URL)")
    }

    /// Asks control for epoch `wanted` or later; the worker holds `held`.
    pub(crate) fn ask(&mut self, wanted: u32, held: u32) {
        if self.running.is_some() {
            self.next = Some(match self.next {
                Some((w, _)) => (w.max(wanted), held),
                None => (wanted, held),
            });
            return;
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        let Some(control) = self.control.clone() else {
            let _ = tx.send(Fetched::Failed {
                wanted,
                held,
                waited: Duration::ZERO,
                message: "no control URL to ask".into(),
                job_failed: false,
            });
            self.running = Some(rx);
            return;
        };
        let job = self.job;
        let spawned = std::thread::Builder::new()
            .name(format!("phub-epoch-{}", self.job))
            .spawn(move || {
                let _ = tx.send(fetch(&control, job, wanted, held));
            });
        if let Err(e) = spawned {
            let (tx, rx) = crossbeam_channel::bounded(1);
            let _ = tx.send(Fetched::Failed {
                wanted,
                held,
                waited: Duration::ZERO,
                message: format!("starting the thread that asks control: {e}"),
                job_failed: false,
            });
            self.running = Some(rx);
            return;
        }
        self.running = Some(rx);
    }

    /// The outcome of the fetch that ran, once it has ended; then the
    /// question asked meanwhile, if any, is asked.
    pub(crate) fn poll(&mut self) -> Option<Fetched> {
        let rx = self.running.as_ref()?;
        let got = match rx.try_recv() {
            Ok(f) => f,
            Err(TryRecvError::Empty) => return None,
            Err(TryRecvError::Disconnected) => Fetched::Failed {
                wanted: 0,
                held: 0,
                waited: Duration::ZERO,
                message: "the thread that asks control ended without an answer".into(),
                job_failed: false,
            },
        };
        self.running = None;
        if let Some((wanted, held)) = self.next.take() {
            self.ask(wanted, held);
        }
        Some(got)
    }

    /// The error control's answer that the job failed ends the job's
    /// requests with.
    pub(crate) fn job_failed(&self, message: &str) -> WorkerError {
        WorkerError::JobFailed {
            job: self.job,
            url: self.url().to_string(),
            message: message.to_string(),
        }
    }

    /// The error a failed fetch of an epoch an appliance named ends the
    /// job's requests with.
    pub(crate) fn error(&self, wanted: u32, held: u32, waited: Duration, message: &str) -> WorkerError {
        WorkerError::Epoch {
            job: self.job,
            wanted,
            held,
            url: self.url().to_string(),
            waited,
            message: message.to_string(),
        }
    }
}

/// Asks `control` (one URL, or several separated by commas: each call
/// goes through [`phub_http::Controls`]) for the job's epoch until it is
/// `wanted` or later, for [`EPOCH_WAIT`] at most.
fn fetch(control: &str, job: u16, wanted: u32, held: u32) -> Fetched {
    let start = Instant::now();
    let call = phub_proto::routes::control::epoch(job);
    let timeouts = Timeouts {
        connect: HTTP_TIMEOUT,
        call: HTTP_TIMEOUT,
        wait: HTTP_TIMEOUT,
    };
    let controls = match Controls::new(control, None, timeouts) {
        Ok(c) => c,
        Err(e) => {
            return Fetched::Failed {
                wanted,
                held,
                waited: Duration::ZERO,
                message: e.to_string(),
                job_failed: false,
            }
        }
    };
    loop {
        let message = match controls.send(&call) {
            Ok(view) if view.epoch >= wanted => return Fetched::View(view),
            Ok(view) => format!("control serves epoch {}", view.epoch),
            // The job failed (PROTOCOL.md §11.6), or is not admitted
            // (evicted): control says why.
            Err(e) if matches!(e.status(), Some(409 | 404)) => {
                return Fetched::Failed {
                    wanted,
                    held,
                    waited: start.elapsed(),
                    message: e.to_string(),
                    job_failed: true,
                }
            }
            Err(e) => e.to_string(),
        };
        let waited = start.elapsed();
        if waited >= EPOCH_WAIT {
            return Fetched::Failed {
                wanted,
                held,
                waited,
                message,
                job_failed: false,
            };
        }
        std::thread::sleep(RETRY);
    }
}
