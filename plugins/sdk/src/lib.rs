//! Write kvgate policies in a few lines of Rust.
//!
//! Policies are `#![no_std]` crates (with `extern crate alloc;` for `String`, `Vec` and
//! `format!`): Rust's std on wasm32-wasip2 imports WASI (stdio, environment, exit) for its
//! panic and I/O machinery, and the gateway refuses any component that imports anything. This
//! crate supplies the allocator and a panic handler (a panic traps; the gateway then answers
//! with the model's fallback mode and counts the failure), and [`Local`] for per-instance
//! settings.
//!
//! A routing policy implements [`routing::Policy`] and exports itself with
//! [`export_router!`](crate::export_router); a rescheduling policy implements
//! [`rescheduling::Policy`] and uses [`export_rescheduler!`](crate::export_rescheduler). Build
//! with `cargo build --release --target wasm32-wasip2`; the `.wasm` in
//! `target/wasm32-wasip2/release/` is what the gateway's config names. A policy must not print,
//! read files, or ask for the time or randomness: the gateway grants no imports and refuses a
//! component that needs any. See plugins/README.md.

#![no_std]

extern crate alloc;

#[cfg(all(feature = "runtime", target_arch = "wasm32"))]
mod runtime {
    #[global_allocator]
    static ALLOC: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

    #[panic_handler]
    fn panic(_: &core::panic::PanicInfo<'_>) -> ! {
        core::arch::wasm32::unreachable()
    }

    /// Byte comparison for slices and strings. The wasm32-wasip2 target expects libc to supply
    /// it, and without std there is no libc.
    ///
    /// # Safety
    /// `a` and `b` are valid for `n` bytes.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
        for i in 0..n {
            // SAFETY: i < n, within both regions.
            let (x, y) = unsafe { (*a.add(i), *b.add(i)) };
            if x != y {
                return i32::from(x) - i32::from(y);
            }
        }
        0
    }

    /// `memcmp` when only equality matters (LLVM emits calls to either).
    ///
    /// # Safety
    /// As [`memcmp`].
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
        // SAFETY: same contract.
        unsafe { memcmp(a, b, n) }
    }

    /// The canonical ABI's allocator export, through which the host passes arguments. On
    /// wasm32-wasip2, wit-bindgen leaves it to std (wasi-libc exports it); a `no_std` guest
    /// has neither, so the SDK supplies it.
    ///
    /// # Safety
    /// Called by the host only, with the canonical ABI's contract: `old_ptr`/`old_len`
    /// describe an earlier allocation of the same `align` (or are 0), `align` is a power of two.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn cabi_realloc(old_ptr: *mut u8, old_len: usize, align: usize, new_len: usize) -> *mut u8 {
        use alloc::alloc::{Layout, alloc, dealloc, handle_alloc_error, realloc};
        if new_len == 0 {
            if old_len != 0 {
                // SAFETY: the old allocation was made here with this size and alignment.
                unsafe { dealloc(old_ptr, Layout::from_size_align_unchecked(old_len, align)) };
            }
            return align as *mut u8;
        }
        let Ok(layout) = Layout::from_size_align(new_len, align) else { core::arch::wasm32::unreachable() };
        // SAFETY: the layout is non-zero; an old allocation was made here with `align`.
        let ptr = unsafe {
            if old_len == 0 { alloc(layout) } else { realloc(old_ptr, Layout::from_size_align_unchecked(old_len, align), new_len) }
        };
        if ptr.is_null() {
            handle_alloc_error(layout);
        }
        ptr
    }
}

/// Per-instance state, such as settings parsed in `init`. A guest instance runs one call at a
/// time on one thread, so plain interior mutability is enough; the gateway may run several
/// instances of a policy, each with its own state, and replace them at any time.
pub struct Local<T>(core::cell::RefCell<T>);

// SAFETY: a WebAssembly guest instance is single-threaded; no two calls ever overlap. Native
// builds (a policy's unit tests) have threads, so there `Local` is not `Sync`.
#[cfg(target_family = "wasm")]
unsafe impl<T> Sync for Local<T> {}

impl<T> Local<T> {
    /// State starting at `value`.
    pub const fn new(value: T) -> Self {
        Self(core::cell::RefCell::new(value))
    }

    /// Runs `f` with the state.
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        f(&mut self.0.borrow_mut())
    }
}

/// Generated bindings of the `router` world (kvgate-policy.wit).
#[doc(hidden)]
pub mod router {
    wit_bindgen::generate!({
        path: "../wit",
        world: "router",
        pub_export_macro: true,
        export_macro_name: "__export_router_world",
        default_bindings_module: "kvgate_policy_sdk::router",
    });
}

/// Generated bindings of the `rescheduler` world.
#[doc(hidden)]
pub mod rescheduler {
    wit_bindgen::generate!({
        path: "../wit",
        world: "rescheduler",
        pub_export_macro: true,
        export_macro_name: "export_rescheduler",
        default_bindings_module: "kvgate_policy_sdk::rescheduler",
    });
}

pub use rescheduler::export_rescheduler;

#[doc(hidden)]
pub mod __private {
    pub use alloc::string::String;
}

/// Exports a type implementing [`routing::Policy`] as the component's routing policy.
#[macro_export]
macro_rules! export_router {
    ($policy:ty) => {
        const _: () = {
            struct KvgateRouter;
            impl $crate::router::exports::kvgate::policy::routing::Guest for KvgateRouter {
                fn init(config: $crate::__private::String) -> Result<(), $crate::__private::String> {
                    <$policy as $crate::routing::Policy>::init(config)
                }
                fn choose(req: $crate::routing::Request, workers: $crate::routing::Workers) -> $crate::routing::Decision {
                    <$policy as $crate::routing::Policy>::choose(req, $crate::routing::unpack(&workers))
                }
            }
            $crate::router::__export_router_world!(KvgateRouter);
        };
    };
}

/// Routing: what a policy sees and answers, and helpers for common answers.
pub mod routing {
    pub use crate::router::kvgate::policy::types::{Decision, Header, Rejection, Request, Workers};
    use alloc::string::String;
    use alloc::vec::Vec;

    /// One candidate worker and its load as the gateway sees it at decision time: the same
    /// figures the built-in modes decide on.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub struct Worker {
        /// Stable id within the model: the worker's position in the config's worker list.
        pub id: u32,
        /// Requests the gateway has in flight to it.
        pub in_flight: u32,
        /// Leading prompt blocks already in its KV cache.
        pub overlap_blocks: u32,
        /// Leading prompt blocks already booked on it by requests in flight.
        pub active_overlap_blocks: u32,
        /// Prefill tokens booked on it that have not produced a first token yet.
        pub active_prefill_tokens: u64,
        /// KV blocks booked on it.
        pub active_blocks: u64,
        /// Its KV capacity in blocks (0 = not reported yet).
        pub total_blocks: u64,
        /// Its reported KV cache usage in [0, 1].
        pub kv_usage: f64,
        /// Its reported waiting (queued) requests.
        pub waiting: u32,
        /// Over a busy threshold (offered only when every worker is).
        pub busy: bool,
        /// Passing health checks.
        pub healthy: bool,
    }

    /// A routing policy; export it with [`export_router!`](crate::export_router).
    pub trait Policy {
        /// Called once per instance with the `config` text of the gateway's YAML; an error
        /// refuses the plugin (the old one keeps serving).
        fn init(config: String) -> Result<(), String>;
        /// Picks among `workers` (never empty) for `req`.
        fn choose(req: Request, workers: Vec<Worker>) -> Decision;
    }

    /// The candidates as records, from the columns the host sends.
    pub fn unpack(w: &Workers) -> Vec<Worker> {
        let n = w.id.len();
        (0..n)
            .map(|i| Worker {
                id: w.id[i],
                in_flight: w.in_flight.get(i).copied().unwrap_or(0),
                overlap_blocks: w.overlap_blocks.get(i).copied().unwrap_or(0),
                active_overlap_blocks: w.active_overlap_blocks.get(i).copied().unwrap_or(0),
                active_prefill_tokens: w.active_prefill_tokens.get(i).copied().unwrap_or(0),
                active_blocks: w.active_blocks.get(i).copied().unwrap_or(0),
                total_blocks: w.total_blocks.get(i).copied().unwrap_or(0),
                kv_usage: w.kv_usage.get(i).copied().unwrap_or(0.0),
                waiting: w.waiting.get(i).copied().unwrap_or(0),
                busy: w.flags.get(i).is_some_and(|f| f & 1 != 0),
                healthy: w.flags.get(i).is_some_and(|f| f & 2 != 0),
            })
            .collect()
    }

    /// The value of header `name` (lower-case), if the gateway passed it.
    pub fn header<'a>(req: &'a Request, name: &str) -> Option<&'a str> {
        req.headers.iter().find(|h| h.name == name).map(|h| h.value.as_str())
    }

    /// kvgate's `kv` cost of sending `req` to `w` (lower is better):
    /// `weight · prefill_blocks + decode_blocks`, as the built-in mode computes it with
    /// `track_active_blocks` on (the default).
    pub fn kv_cost(req: &Request, w: &Worker, weight: f64) -> f64 {
        let bs = f64::from(req.block_size.max(1));
        let cached = (f64::from(w.overlap_blocks) * bs).min(f64::from(req.prompt_tokens));
        let prefill_blocks = (w.active_prefill_tokens as f64 + f64::from(req.prompt_tokens) - cached) / bs;
        let decode_blocks = w.active_blocks as f64 + f64::from(req.prompt_blocks.saturating_sub(w.active_overlap_blocks));
        weight * prefill_blocks + decode_blocks
    }

    /// The worker with the lowest `kv_cost` (ties: fewer in flight, then the first).
    pub fn cheapest(req: &Request, workers: &[Worker], weight: f64) -> Decision {
        let best = workers
            .iter()
            .map(|w| (kv_cost(req, w, weight), w.in_flight, w.id))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        match best {
            Some((_, _, id)) => Decision::Worker(id),
            None => Decision::Fallback,
        }
    }

    /// A stable 64-bit hash of `s` (FNV-1a), for affinity keys: the same key always maps to
    /// the same value, in every instance and across gateway restarts.
    pub fn stable_hash(s: &str) -> u64 {
        s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
    }
}

/// Rescheduling: the cluster view and the migrations a policy proposes.
pub mod rescheduling {
    pub use crate::rescheduler::exports::kvgate::policy::rescheduling::Guest as Policy;
    pub use crate::rescheduler::kvgate::policy::types::{ClusterView, Migration, Running, SelectOrder, SelectRule, WorkerLoad};
}
