//! The smallest useful routing policy: send each request to the worker with the most free KV
//! cache, unless a header says otherwise; with no opinion, leave it to the fallback mode.

#![no_std]

extern crate alloc;

use alloc::string::String;
use kvgate_policy_sdk::routing::{Decision, Policy, Request, Worker, header};

struct MyPolicy;

impl Policy for MyPolicy {
    fn init(_config: String) -> Result<(), String> {
        Ok(())
    }

    fn choose(req: Request, workers: alloc::vec::Vec<Worker>) -> Decision {
        if header(&req, "x-route") == Some("default") {
            return Decision::Fallback;
        }
        match workers.iter().min_by(|a, b| a.kv_usage.total_cmp(&b.kv_usage)) {
            Some(w) => Decision::Worker(w.id),
            None => Decision::Fallback,
        }
    }
}

kvgate_policy_sdk::export_router!(MyPolicy);
