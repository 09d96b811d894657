//! A routing guest that prints, so its component imports WASI's stdout: the host grants no
//! imports and must refuse to load it.

use kvgate_policy_sdk::routing::{Decision, Policy, Request, Worker};

struct Forbidden;

impl Policy for Forbidden {
    fn init(_config: String) -> Result<(), String> {
        Ok(())
    }

    fn choose(req: Request, workers: Vec<Worker>) -> Decision {
        println!("routing {}", req.id);
        Decision::Worker(workers[0].id)
    }
}

kvgate_policy_sdk::export_router!(Forbidden);
