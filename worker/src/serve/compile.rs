//! Structured-output grammars compiled off the engine's step loop. A big
//! JSON schema can take tens of milliseconds to compile, which would stall
//! every running request's next token; so the engine thread hands each
//! constrained request to one compiler thread and goes on stepping. The
//! request joins the engine when its grammar is ready, unless it was
//! aborted meanwhile (an abort of a waiting request just forgets it, so
//! the order of Generate and Abort is kept).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use common::structured::{GrammarCompiler, StructuredError};
use common::{RequestId, SamplingParams, StructuredOutput};

use crate::runner::grammar::{self, RequestGrammar};

/// A request whose grammar is compiling.
pub struct Waiting {
    pub prompt: Vec<u32>,
    /// Tokens generated before, on a worker that was lost.
    pub output: Vec<u32>,
    pub params: SamplingParams,
    pub priority: i32,
    pub arrived: Instant,
}

/// A request whose grammar compiled, or failed to.
pub struct Compiled {
    pub id: RequestId,
    pub request: Waiting,
    pub grammar: Result<RequestGrammar, StructuredError>,
}

type Job = (RequestId, Arc<GrammarCompiler>, StructuredOutput, Vec<u32>);
type Done = (RequestId, Result<RequestGrammar, StructuredError>);

#[derive(Default)]
pub struct PendingCompiles {
    waiting: HashMap<RequestId, Waiting>,
    /// The compiler thread's queue and results, once started.
    thread: Option<(mpsc::Sender<Job>, mpsc::Receiver<Done>)>,
    /// Compiled here, when no thread could be started.
    ready: Vec<Done>,
}

impl PendingCompiles {
    /// Queues `request`'s grammar (it must have one) for `compiler`.
    pub fn start(&mut self, id: RequestId, compiler: Arc<GrammarCompiler>, request: Waiting) {
        let Some(constraint) = request.params.structured_output.clone() else { return };
        let job = (id, compiler, constraint, request.output.clone());
        if self.thread.is_none() {
            self.thread = spawn_compiler();
        }
        let unsent = match &self.thread {
            Some((jobs, _)) => jobs.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(job) = unsent {
            self.ready.push(compile(job));
        }
        self.waiting.insert(id, request);
    }

    /// Forgets a waiting request; false if `id` is not waiting.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        self.waiting.remove(&id).is_some()
    }

    /// Forgets every waiting request, returning their ids.
    pub fn cancel_all(&mut self) -> Vec<RequestId> {
        self.waiting.drain().map(|(id, _)| id).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// The requests whose compile ended since the last call (those aborted
    /// meanwhile left out).
    pub fn finished(&mut self) -> Vec<Compiled> {
        let mut done = std::mem::take(&mut self.ready);
        if let Some((_, results)) = &self.thread {
            done.extend(results.try_iter());
        }
        done.into_iter()
            .filter_map(|(id, grammar)| Some(Compiled { id, request: self.waiting.remove(&id)?, grammar }))
            .collect()
    }
}

fn compile((id, compiler, constraint, output): Job) -> Done {
    let compiled =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| grammar::prepare(&compiler, &constraint, &output)));
    (id, compiled.unwrap_or_else(|_| Err(StructuredError("the grammar compiler panicked".into()))))
}

/// One thread that compiles jobs in order until its queue is dropped;
/// `None` if the thread cannot be started.
fn spawn_compiler() -> Option<(mpsc::Sender<Job>, mpsc::Receiver<Done>)> {
    let (jobs_tx, jobs) = mpsc::channel::<Job>();
    let (done, done_rx) = mpsc::channel::<Done>();
    let spawned = std::thread::Builder::new().name("grammar-compiler".into()).spawn(move || {
        for job in jobs {
            if done.send(compile(job)).is_err() {
                return;
            }
        }
    });
    match spawned {
        Ok(_) => Some((jobs_tx, done_rx)),
        Err(e) => {
            tracing::warn!("cannot start the grammar compiler thread ({e}); compiling on the engine thread");
            None
        }
    }
}
