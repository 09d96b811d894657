//! A routing guest that misbehaves on purpose, for the host's tests. Config `mode = …`:
//! `pin-last` (default: every request to the highest worker id, a well-behaved policy),
//! `loop`, `trap`, `hog` (grows memory without bound), `bad-index`, `bad-scores`,
//! `bad-status`, `reject` (a valid 429), `init-error`.

#![no_std]

extern crate alloc;

use alloc::string::{String, ToString};
use alloc::vec;
use alloc::vec::Vec;
use kvgate_policy_sdk::Local;
use kvgate_policy_sdk::routing::{Decision, Policy, Rejection, Request, Worker};

static MODE: Local<String> = Local::new(String::new());

struct Hostile;

impl Policy for Hostile {
    fn init(config: String) -> Result<(), String> {
        let mode = config.lines().find_map(|l| l.trim().strip_prefix("mode")).map(|v| v.trim_start_matches([' ', '=']).trim().to_string());
        let mode = mode.unwrap_or_else(|| "pin-last".to_string());
        if mode == "init-error" {
            return Err("refusing to start, as configured".to_string());
        }
        MODE.with(|m| *m = mode);
        Ok(())
    }

    fn choose(_req: Request, workers: Vec<Worker>) -> Decision {
        let mode = MODE.with(|m| m.clone());
        match mode.as_str() {
            "loop" => {
                let mut x = 0u64;
                loop {
                    x = core::hint::black_box(x.wrapping_add(1));
                }
            }
            "trap" => panic!("policy bug"),
            "hog" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(Vec::with_capacity(8 << 20));
                    core::hint::black_box(&hoard);
                }
            }
            "bad-index" => Decision::Worker(9999),
            "bad-scores" => Decision::Scores(vec![1.0; workers.len() + 3]),
            "bad-status" => Decision::Reject(Rejection { status: 200, message: "ok?".to_string() }),
            "reject" => Decision::Reject(Rejection { status: 429, message: "tenant over quota".to_string() }),
            _ => Decision::Worker(workers.iter().map(|w| w.id).max().unwrap_or(0)),
        }
    }
}

kvgate_policy_sdk::export_router!(Hostile);
