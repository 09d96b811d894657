//! `kvgate-bench`: an open-loop load generator for any OpenAI-compatible endpoint, and a
//! compare mode that runs the same workload through kvgate and other routers in front of a
//! fresh vllm-sim cluster each.
//!
//!   kvgate-bench run --url http://127.0.0.1:8080 --model kvgate-demo --workload trace --speedup 20
//!   kvgate-bench compare --workers 8 --workload trace --speedup 4 --max-requests 600
//!
//! Results: a table on stdout and `results.json`, `results.md`, `ttft_cdf.svg` in `--out`.

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvgate_bench::cluster::{self, Procs, SimOptions};
use kvgate_bench::load::report::{self, Report, Slo};
use kvgate_bench::load::workload::{self, Api, Workload};
use kvgate_bench::load::{RunOptions, run};
use kvgate_bench::peers::{self, Peer};
use kvgate_bench::{replicas, trace, trace_floor};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Parser)]
#[command(name = "kvgate-bench", about = "Load generator and router comparison for OpenAI-compatible LLM servers")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Send a workload to one endpoint.
    Run {
        /// Base URL of the target.
        #[arg(long)]
        url: String,
        /// Name in the report.
        #[arg(long, default_value = "target")]
        label: String,
        /// Base URLs of the workers behind it, comma-separated, for their prefix-cache hit rate.
        #[arg(long, value_delimiter = ',')]
        workers: Vec<String>,
        #[command(flatten)]
        common: Common,
    },
    /// Start a vllm-sim cluster per target and run the same workload through each.
    Compare {
        /// Workers in the cluster.
        #[arg(long, default_value_t = 8)]
        workers: usize,
        /// Targets, comma-separated: kvgate-<mode> (kv, round_robin, random),
        /// vllm-router-<policy> (round_robin, cache_aware, kv_aware, ...), smg-<policy>
        /// (cache_aware, ...). Options follow `@`, `;`-separated. A kvgate target takes routing
        /// keys: `kvgate-kv@overlap_score_weight=8`. A peer takes its own command-line options,
        /// `key=value` as `--key value` and a bare `key` as `--key`
        /// (`vllm-router-cache_aware@cache-threshold=0.5;balance-abs-threshold=32`), and `docs`
        /// for the configuration its documentation recommends: vllm-router cache_aware
        /// `--cache-threshold 0.5 --balance-abs-threshold 32 --balance-rel-threshold 1.1` (its
        /// load-balancing guide; vllm-router 0.1.17 defaults to 0.3 / 64 / 1.5), SMG cache_aware
        /// `--cache-threshold 0.5 --balance-abs-threshold 32 --balance-rel-threshold 1.5
        /// --eviction-interval-secs 120 --max-tree-size 67108864` (the SGLang Model Gateway
        /// guide; sglang-router 0.3.2 defaults to 0.3 / 64 / 1.5 / 60 s). vllm-router kv_aware's
        /// workers run as its documentation requires: sha256_cbor hashes published as 32-byte
        /// digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), PYTHONHASHSEED=0, event topic "".
        #[arg(long, value_delimiter = ',', default_value = "kvgate-kv,kvgate-round_robin,vllm-router-cache_aware,vllm-router-kv_aware,smg-cache_aware")]
        targets: Vec<String>,
        /// The vllm-sim binary.
        #[arg(long, default_value = "target/release/vllm-sim")]
        sim_bin: PathBuf,
        /// The kvgate binary.
        #[arg(long, default_value = "target/release/kvgate")]
        kvgate_bin: PathBuf,
        /// Extra vllm-sim arguments, space-separated (e.g. "--time-scale 4").
        #[arg(long, default_value = "", allow_hyphen_values = true)]
        sim_args: String,
        /// Extra lines for kvgate's routing section, `;`-separated (e.g. "overlap_score_weight: 2").
        #[arg(long, default_value = "")]
        kvgate_routing: String,
        /// The vllm-router binary (skipped when absent).
        #[arg(long, default_value = "vllm-router")]
        vllm_router_bin: String,
        /// The SMG / sglang-router launcher (skipped when absent).
        #[arg(long, default_value = "smg")]
        smg_bin: String,
        /// Before measuring each target, send this many requests of the same workload (the next
        /// seed, one output token) straight to every worker, once the target runs, so that every
        /// worker caches the shared prefixes: a fleet warmed by earlier traffic. 0: fresh
        /// workers. shared-prefix only (its prefixes do not depend on the seed). Routers that
        /// learn the caches from KV events see the warm-up; those that learn from the requests
        /// they route (cache_aware) do not.
        #[arg(long, default_value_t = 0)]
        warm: usize,
        #[command(flatten)]
        common: Common,
    },
    /// The rescheduler on a skewed fleet: a burst of long decodes on the first workers, then a
    /// scale-out; the same burst without and with `decode_load`.
    Reschedule(RescheduleArgs),
    /// The planner (Dynamo's design) with the local connector starting vllm-sim workers: a load
    /// ramp up and down, and a scale-down by migration against one by waiting.
    Planner(PlannerArgs),
    /// What idle and slow clients cost: resident memory and descriptors per held connection,
    /// for several client shapes, kvgate beside nginx (docs/hardening.md).
    Connections(ConnectionsArgs),
    /// Many concurrent streams for a long time with cancels, worker kills and reloads: memory,
    /// descriptors, errors and bookings per interval (docs/hardening.md).
    Soak(SoakArgs),
    /// Streaming clients at multiples of the fleet's capacity, without and with load shedding:
    /// answers by kind, TTFT of the accepted, memory, descriptors, bookings after.
    Overload(OverloadArgs),
    /// Many users on one fleet: a tenant's steady load alone, beside a flooding one through
    /// the FIFO queue and through fair queuing, and two flooding tenants of weights 1 and 3
    /// (docs/tenants.md).
    Tenants(TenantsArgs),
    /// Several kvgate replicas in front of one fleet, each request sent to one at random (an
    /// L4 balancer): one replica, replicas sharing over NATS, replicas without, the leader
    /// killed, NATS restarted (docs/replicas.md).
    Replicas {
        /// Workers in the cluster.
        #[arg(long, default_value_t = 8)]
        workers: usize,
        /// Replicas in the multi-replica cases.
        #[arg(long, default_value_t = 3)]
        replicas: usize,
        /// Cases, comma-separated: one, shared, unshared, kill, kill-follower, nats.
        #[arg(long, value_delimiter = ',', default_value = "one,shared,unshared,kill,kill-follower,nats")]
        cases: Vec<String>,
        /// The vllm-sim binary.
        #[arg(long, default_value = "target/release/vllm-sim")]
        sim_bin: PathBuf,
        /// The kvgate binary.
        #[arg(long, default_value = "target/release/kvgate")]
        kvgate_bin: PathBuf,
        /// Extra vllm-sim arguments, space-separated.
        #[arg(long, default_value = "", allow_hyphen_values = true)]
        sim_args: String,
        #[command(flatten)]
        common: Common,
    },
    /// A prefill-heavy workload through kvgate on aggregated workers, then on the same number
    /// split into prefill and decode workers: ITL, TTFT (with the transfer's share), e2e.
    Disagg(DisaggArgs),
}

#[derive(Args)]
struct DisaggArgs {
    /// The vllm-sim binary.
    #[arg(long, default_value = "target/release/vllm-sim")]
    sim_bin: PathBuf,
    /// The kvgate binary.
    #[arg(long, default_value = "target/release/kvgate")]
    kvgate_bin: PathBuf,
    /// Where the configs and results go.
    #[arg(long, default_value = "benches/out/disagg")]
    out: PathBuf,
    /// Workers per case (the disaggregated case: half prefill, half decode).
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Prompt tokens per request (unique prompts).
    #[arg(long, default_value_t = 4096)]
    prompt_tokens: usize,
    /// Output tokens per stream.
    #[arg(long, default_value_t = 128)]
    output_tokens: usize,
    /// Arrivals per second (Poisson).
    #[arg(long, default_value_t = 6.0)]
    rate: f64,
    /// Seconds of arrivals per case.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// vllm-sim's --time-scale.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Extra vllm-sim arguments of every worker, `;`-separated.
    #[arg(long, default_value = "")]
    sim_args: String,
}

async fn disagg(a: DisaggArgs) -> i32 {
    let o = kvgate_bench::disagg::Options {
        sim_bin: a.sim_bin,
        kvgate_bin: a.kvgate_bin,
        out: a.out,
        workers: a.workers.max(2),
        prompt_tokens: a.prompt_tokens,
        output_tokens: a.output_tokens,
        rate: a.rate,
        duration: Duration::from_secs_f64(a.seconds),
        time_scale: a.time_scale,
        sim_args: a.sim_args.split(';').filter(|s| !s.is_empty()).flat_map(|s| s.split_whitespace().map(String::from).collect::<Vec<_>>()).collect(),
    };
    println!("{}", kvgate_bench::disagg::Case::HEAD);
    match kvgate_bench::disagg::run(&o).await {
        Ok(cases) => {
            for c in &cases {
                for f in &c.failures {
                    println!("{}: {f}", c.name);
                }
            }
            let _ = std::fs::write(o.out.join("disagg.json"), serde_json::to_string_pretty(&cases).unwrap_or_default());
            i32::from(cases.iter().any(|c| c.failed > 0))
        }
        Err(e) => {
            eprintln!("kvgate-bench disagg: {e}");
            1
        }
    }
}

#[derive(Args)]
struct OverloadArgs {
    /// The vllm-sim binary.
    #[arg(long, default_value = "target/release/vllm-sim")]
    sim_bin: PathBuf,
    /// The kvgate binary.
    #[arg(long, default_value = "target/release/kvgate")]
    kvgate_bin: PathBuf,
    /// Where the configs go.
    #[arg(long, default_value = "benches/out/overload")]
    out: PathBuf,
    /// Workers.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Whole streams each worker's KV cache holds (its batch could take more). The fleet's
    /// capacity is workers times this.
    #[arg(long, default_value_t = 16)]
    streams_per_worker: usize,
    /// Loads, as multiples of the capacity, comma-separated; each runs without and with shedding.
    #[arg(long, value_delimiter = ',', default_value = "0.5,3")]
    factors: Vec<f64>,
    /// Seconds of load per case.
    #[arg(long, default_value_t = 45.0)]
    seconds: f64,
    /// Output tokens per stream.
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// vllm-sim's --time-scale.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// The shedding section of the shedding cases, `;`-separated YAML lines.
    #[arg(long, default_value = "active_decode_blocks_threshold: 0.85")]
    shedding: String,
    /// Extra lines of the model's routing section, `;`-separated (empty: the defaults).
    #[arg(long, default_value = "")]
    routing: String,
    /// Milliseconds a refused client waits before it sends again.
    #[arg(long, default_value_t = 100)]
    backoff_ms: u64,
    /// Seconds after which a request with no answer counts as a timeout.
    #[arg(long, default_value_t = 60.0)]
    timeout_s: f64,
}

async fn overload(a: OverloadArgs) -> i32 {
    let o = kvgate_bench::overload::Options {
        sim_bin: a.sim_bin,
        kvgate_bin: a.kvgate_bin,
        out: a.out,
        workers: a.workers,
        streams_per_worker: a.streams_per_worker,
        factors: a.factors,
        duration: Duration::from_secs_f64(a.seconds),
        tokens: a.tokens,
        time_scale: a.time_scale,
        shedding: a.shedding.replace(';', "\n"),
        routing: a.routing.replace(';', "\n"),
        backoff: Duration::from_millis(a.backoff_ms),
        timeout: Duration::from_secs_f64(a.timeout_s),
    };
    println!("{}", kvgate_bench::overload::Case::HEAD);
    match kvgate_bench::overload::run(&o).await {
        Ok(cases) => {
            for c in &cases {
                for f in &c.failures {
                    println!("{}x shedding {}: {f}", c.factor, c.shedding);
                }
            }
            let _ = std::fs::write(o.out.join("overload.json"), serde_json::to_string_pretty(&cases).unwrap_or_default());
            // The shedding cases must lose nothing but to refusals, and leave no booking.
            let bad = cases.iter().filter(|c| c.shedding).any(|c| c.failed > 0 || c.timeouts > 0 || c.bookings_after != 0.0);
            i32::from(bad)
        }
        Err(e) => {
            eprintln!("kvgate-bench overload: {e}");
            1
        }
    }
}

#[derive(Args)]
struct TenantsArgs {
    /// The vllm-sim binary.
    #[arg(long, default_value = "target/release/vllm-sim")]
    sim_bin: PathBuf,
    /// The kvgate binary.
    #[arg(long, default_value = "target/release/kvgate")]
    kvgate_bin: PathBuf,
    /// Where the configs and the JSON go.
    #[arg(long, default_value = "benches/out/tenants")]
    out: PathBuf,
    /// Workers.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Whole streams each worker's KV cache holds.
    #[arg(long, default_value_t = 16)]
    streams_per_worker: usize,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 64)]
    output_tokens: usize,
    /// vllm-sim's --time-scale.
    #[arg(long, default_value_t = 0.25)]
    time_scale: f64,
    /// Seconds of load per case.
    #[arg(long, default_value_t = 30.0)]
    seconds: f64,
    /// Seconds at the start of each case left out of the figures.
    #[arg(long, default_value_t = 8.0)]
    warmup: f64,
    /// B's steady rate, requests per second (the fleet serves about 20 of these requests a
    /// second: B's is 0.6 of its fair share).
    #[arg(long, default_value_t = 6.0)]
    b_rps: f64,
    /// A's flood, requests per second (5× its fair share of about 10).
    #[arg(long, default_value_t = 50.0)]
    a_rps: f64,
    /// C's and D's flood each, requests per second (each 1.5× the fleet's capacity).
    #[arg(long, default_value_t = 30.0)]
    weights_rps: f64,
    /// The model's routing.queue_threshold.
    #[arg(long, default_value_t = 0.125)]
    queue_threshold: f64,
    /// Cases, comma-separated: alone, fifo, fair, weights.
    #[arg(long, value_delimiter = ',', default_value = "alone,fifo,fair,weights")]
    cases: Vec<String>,
    /// Seconds after which a request with no answer counts as failed.
    #[arg(long, default_value_t = 90.0)]
    timeout_s: f64,
}

async fn tenants(a: TenantsArgs) -> i32 {
    let o = kvgate_bench::tenants::Options {
        sim_bin: a.sim_bin,
        kvgate_bin: a.kvgate_bin,
        out: a.out,
        workers: a.workers,
        streams_per_worker: a.streams_per_worker,
        prompt_tokens: a.prompt_tokens,
        output_tokens: a.output_tokens,
        time_scale: a.time_scale,
        seconds: a.seconds,
        warmup: a.warmup,
        b_rps: a.b_rps,
        a_rps: a.a_rps,
        weights_rps: a.weights_rps,
        queue_threshold: a.queue_threshold,
        cases: a.cases,
        timeout: Duration::from_secs_f64(a.timeout_s),
    };
    println!("{}", kvgate_bench::tenants::Case::HEAD);
    let cases = match kvgate_bench::tenants::run(&o).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvgate-bench tenants: {e}");
            return 1;
        }
    };
    let _ = std::fs::write(o.out.join("tenants.json"), serde_json::to_string_pretty(&cases).unwrap_or_default());
    let p99 = |case: &str| cases.iter().find(|c| c.name == case).and_then(|c| c.tenant("b")).map(|b| b.ttft_ms[2]);
    if let (Some(alone), Some(fair)) = (p99("alone"), p99("fair")) {
        println!("B's TTFT p99: fair {fair:.0} ms against alone {alone:.0} ms ({:.2}x)", fair / alone);
        if let Some(fifo) = p99("fifo") {
            println!("B's TTFT p99 under FIFO: {fifo:.0} ms ({:.2}x alone)", fifo / alone);
        }
    }
    if let Some(w) = cases.iter().find(|c| c.name == "weights") {
        let served = |t: &str| w.tenant(t).and_then(|x| x.served_tokens).unwrap_or(0) as f64;
        println!("served tokens D/C: {:.3} (weights 3/1)", served("d") / served("c").max(1.0));
    }
    0
}

#[derive(Args)]
struct SoakArgs {
    /// The vllm-sim binary.
    #[arg(long, default_value = "target/release/vllm-sim")]
    sim_bin: PathBuf,
    /// The kvgate binary.
    #[arg(long, default_value = "target/release/kvgate")]
    kvgate_bin: PathBuf,
    /// Where the config and samples go.
    #[arg(long, default_value = "benches/out/soak")]
    out: PathBuf,
    /// Minutes of load.
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// Concurrent streams.
    #[arg(long, default_value_t = 10_000)]
    streams: usize,
    /// Workers.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Output tokens per stream.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// vllm-sim's --time-scale.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 60.0)]
    sample_s: f64,
    /// Seconds between worker kills (0: none).
    #[arg(long, default_value_t = 300.0)]
    kill_s: f64,
    /// Seconds between config reloads (0: none).
    #[arg(long, default_value_t = 120.0)]
    reload_s: f64,
    /// Share of streams cancelled by their client.
    #[arg(long, default_value_t = 0.1)]
    cancel_share: f64,
}

async fn soak(a: SoakArgs) -> i32 {
    let o = kvgate_bench::soak::Options {
        sim_bin: a.sim_bin,
        kvgate_bin: a.kvgate_bin,
        out: a.out,
        duration: Duration::from_secs_f64(a.minutes * 60.0),
        streams: a.streams,
        workers: a.workers,
        tokens: a.tokens,
        time_scale: a.time_scale,
        sample_every: Duration::from_secs_f64(a.sample_s),
        kill_every: Duration::from_secs_f64(a.kill_s),
        reload_every: Duration::from_secs_f64(a.reload_s),
        cancel_share: a.cancel_share,
    };
    match kvgate_bench::soak::run(&o).await {
        Ok(r) => {
            println!("{}", kvgate_bench::soak::Sample::HEAD);
            for s in &r.samples {
                println!("{}", s.row());
            }
            println!("final bookings {}, requests in flight {}, TTFT p50 {:.0} ms p99 {:.0} ms", r.final_bookings, r.final_in_flight, r.ttft_ms.0, r.ttft_ms.1);
            for e in &r.other_errors {
                println!("error away from kills: {e}");
            }
            let failed = r.samples.last().map_or(0, |s| s.failed_other);
            i32::from(r.final_bookings != 0.0 || r.final_in_flight != 0.0 || failed > 0)
        }
        Err(e) => {
            eprintln!("kvgate-bench soak: {e}");
            1
        }
    }
}

#[derive(Args)]
struct ConnectionsArgs {
    /// The kvgate binary.
    #[arg(long, default_value = "target/release/kvgate")]
    kvgate_bin: PathBuf,
    /// Connections per shape (10,000 is kvgate's default max_connections; one more is tried).
    #[arg(long, default_value_t = 10_000)]
    count: usize,
    /// Shapes, comma-separated: idle, partial, trickle, body, oversized.
    #[arg(long, value_delimiter = ',', default_value = "idle,partial,trickle,body,oversized")]
    shapes: Vec<String>,
    /// Seconds the connections are held before memory is read.
    #[arg(long, default_value_t = 5)]
    hold_s: u64,
    /// kvgate's threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Also measure nginx (one worker) in the same run.
    #[arg(long)]
    compare_nginx: bool,
    /// Where configs go.
    #[arg(long, default_value = "benches/out/connections")]
    out: PathBuf,
}

async fn connections(a: ConnectionsArgs) -> i32 {
    let shapes = match a.shapes.iter().map(|s| kvgate_bench::connections::Shape::parse(s)).collect::<Result<Vec<_>, _>>() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvgate-bench: {e}");
            return 2;
        }
    };
    let o = kvgate_bench::connections::Options {
        kvgate_bin: a.kvgate_bin,
        nginx: a.compare_nginx,
        count: a.count,
        shapes,
        hold_s: a.hold_s,
        threads: a.threads,
        out: a.out,
    };
    match kvgate_bench::connections::run(&o).await {
        Ok(figures) => {
            print!("{}", kvgate_bench::connections::table(&figures));
            0
        }
        Err(e) => {
            eprintln!("kvgate-bench connections: {e}");
            1
        }
    }
}

#[derive(Args)]
struct PlannerArgs {
    /// `ramp`, `drain` or `all`.
    #[arg(long, default_value = "all")]
    scenario: String,
    /// The vllm-sim binary.
    #[arg(long, default_value = "target/release/vllm-sim")]
    sim_bin: PathBuf,
    /// The kvgate binary.
    #[arg(long, default_value = "target/release/kvgate")]
    kvgate_bin: PathBuf,
    /// Where the decision logs and the plot go.
    #[arg(long, default_value = "benches/out/planner")]
    out: PathBuf,
    /// vllm-sim's --time-scale.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// vllm-sim's KV blocks per worker.
    #[arg(long, default_value_t = 400)]
    gpu_blocks: usize,
    /// Prompt tokens per stream.
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    /// Output tokens per stream.
    #[arg(long, default_value_t = 256)]
    output_tokens: usize,
    /// ramp: clients in each step, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2,8,16,32,16,8,2")]
    steps: Vec<usize>,
    /// ramp: seconds per step.
    #[arg(long, default_value_t = 20.0)]
    step_s: f64,
    /// The planner's adjustment_interval_s.
    #[arg(long, default_value_t = 5.0)]
    interval_s: f64,
    /// The planner's max_gpu_budget (one GPU per worker).
    #[arg(long, default_value_t = 4)]
    max_workers: u32,
    /// drain: streams running at the scale-down.
    #[arg(long, default_value_t = 16)]
    drain_streams: usize,
    /// drain: their output tokens.
    #[arg(long, default_value_t = 2000)]
    drain_tokens: usize,
}

async fn planner(a: PlannerArgs) -> i32 {
    let o = kvgate_bench::planner::Options {
        sim_bin: a.sim_bin,
        kvgate_bin: a.kvgate_bin,
        out: a.out,
        time_scale: a.time_scale,
        gpu_blocks: a.gpu_blocks,
        prompt_tokens: a.prompt_tokens,
        output_tokens: a.output_tokens,
        steps: a.steps,
        step_s: a.step_s,
        interval_s: a.interval_s,
        max_workers: a.max_workers,
        drain_streams: a.drain_streams,
        drain_tokens: a.drain_tokens,
    };
    let mut code = 0;
    if matches!(a.scenario.as_str(), "ramp" | "all") {
        match kvgate_bench::planner::ramp(&o).await {
            Ok(r) => {
                let changes: Vec<String> = r.changes.iter().map(|(c, ok)| if *ok { c.clone() } else { format!("{c} (failed)") }).collect();
                println!("ramp: clients {:?}, {} s each, adjustment_interval_s {}, max {} workers", o.steps, o.step_s, o.interval_s, o.max_workers);
                println!("| requests | failed | peak workers | changes | oscillated | TTFT p50 | TTFT p99 | ITL p99 |");
                println!("|---:|---:|---:|---|---|---:|---:|---:|");
                println!(
                    "| {} | {} | {} | {} | {} | {:.0} ms | {:.0} ms | {:.1} ms |",
                    r.requests,
                    r.failed,
                    r.peak,
                    changes.join(" "),
                    if r.oscillated { "yes" } else { "no" },
                    r.ttft_ms.0,
                    r.ttft_ms.1,
                    r.itl_p99_ms
                );
                println!("decision log: {}, plot: {}", r.log.display(), r.plot.display());
                if r.failed > 0 || r.oscillated {
                    code = 1;
                }
            }
            Err(e) => {
                eprintln!("kvgate-bench planner ramp: {e}");
                code = 1;
            }
        }
    }
    if matches!(a.scenario.as_str(), "drain" | "all") {
        println!("drain: {} streams of {}+{} tokens on 2 workers, then a scale-down to 1", o.drain_streams, o.prompt_tokens, o.drain_tokens);
        println!("| scale-down | streams | failed | moved | decision → exit | drained in | longest token gap | ITL p99 |");
        println!("|---|---:|---:|---:|---:|---:|---:|---:|");
        for mode in ["migrate", "wait"] {
            match kvgate_bench::planner::drain(&o, mode).await {
                Ok(d) => println!(
                    "| {} | {} | {} | {} | {:.2} s | {:.2} s | {:.0} ms | {:.1} ms |",
                    d.mode, d.streams, d.failed, d.moved, d.decision_to_exit_s, d.drained_s, d.max_gap_ms, d.itl_p99_ms
                ),
                Err(e) => {
                    eprintln!("kvgate-bench planner drain ({mode}): {e}");
                    code = 1;
                }
            }
        }
    }
    code
}

#[derive(Args)]
struct RescheduleArgs {
    /// The vllm-sim binary.
    #[arg(long, default_value = "target/release/vllm-sim")]
    sim_bin: PathBuf,
    /// The kvgate binary.
    #[arg(long, default_value = "target/release/kvgate")]
    kvgate_bin: PathBuf,
    /// Workers the burst lands on.
    #[arg(long, default_value_t = 1)]
    initial: usize,
    /// Workers after the scale-out.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Streams in the burst.
    #[arg(long, default_value_t = 160)]
    requests: usize,
    /// Prompt tokens per stream.
    #[arg(long, default_value_t = 2048)]
    prompt_tokens: usize,
    /// Output tokens per stream.
    #[arg(long, default_value_t = 1024)]
    output_tokens: usize,
    /// vllm-sim's --time-scale.
    #[arg(long, default_value_t = 2.0)]
    time_scale: f64,
    /// vllm-sim's KV blocks per worker.
    #[arg(long, default_value_t = 32768)]
    gpu_blocks: usize,
    /// The `rescheduling` section of the run with the rescheduler, `;`-separated lines.
    #[arg(
        long,
        default_value = "enable_rescheduling: true;rescheduling_policies: decode_load;rescheduling_interval_ms: 100;rescheduling_decode_load_threshold: 0.3;rescheduling_load_balance_threshold: 0.1;rescheduling_req_select_rule: NUM_REQ;rescheduling_req_select_order: LR;rescheduling_req_select_value: 4"
    )]
    rescheduling: String,
}

async fn reschedule(a: RescheduleArgs) -> i32 {
    let o = kvgate_bench::reschedule::Options {
        sim_bin: a.sim_bin,
        kvgate_bin: a.kvgate_bin,
        initial: a.initial,
        total: a.workers,
        requests: a.requests,
        prompt_tokens: a.prompt_tokens,
        output_tokens: a.output_tokens,
        time_scale: a.time_scale,
        gpu_blocks: a.gpu_blocks,
        rescheduling: a.rescheduling.replace(';', "\n"),
    };
    let (off, on) = match kvgate_bench::reschedule::run(&o).await {
        Ok(x) => x,
        Err(e) => {
            eprintln!("kvgate-bench: {e}");
            return 1;
        }
    };
    let prefill = kvgate_bench::reschedule::sim_prefill_ms(o.prompt_tokens + o.output_tokens / 2, o.time_scale);
    println!(
        "{} streams of {}+{} tokens on {} of {} workers (vllm-sim --time-scale {}), then a scale-out",
        o.requests, o.prompt_tokens, o.output_tokens, o.initial, o.total, o.time_scale
    );
    println!("| run | ok | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | moves | pause p50 | pause p99 |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, f) in [("without the rescheduler", &off), ("decode_load", &on)] {
        println!(
            "| {name} | {} | {:.0} ms | {:.0} ms | {:.1} ms | {:.1} ms | {} | {:.0} ms | {:.0} ms |",
            f.ok,
            f.ttft_ms.0,
            f.ttft_ms.1,
            f.tpot_ms.0,
            f.tpot_ms.1,
            f.moves + 0.0,
            f.pause_ms.0,
            f.pause_ms.1
        );
    }
    let gain = if on.tpot_ms.1 > 0.0 { off.tpot_ms.1 / on.tpot_ms.1 } else { 0.0 };
    println!(
        "TPOT p99 ratio (without / with): {gain:.2}x; one prefill of a mid-stream continuation ({} tokens) on an idle destination: {prefill:.0} ms, pause p99 / prefill: {:.2}",
        o.prompt_tokens + o.output_tokens / 2,
        on.pause_ms.1 / prefill
    );
    0
}

#[derive(Clone, Copy, ValueEnum)]
enum Kind {
    /// Replay a Mooncake trace (token ids).
    Trace,
    /// Synthetic shared-prefix traffic: --groups prefixes of --prefix-tokens plus
    /// --suffix-tokens of each request's own (default: 32 prefixes of 384 + 128, short prompts),
    /// Poisson at --rate.
    SharedPrefix,
    /// Multi-turn chat sessions (text), each turn after the previous answer.
    Chat,
    /// Multi-turn coding-agent sessions: a shared system prompt (--system-tokens) and tool list
    /// (--tools), a task, then turns returning the result (--tool-result-tokens) of a tool call
    /// appended to the previous answer, a user follow-up every 4th turn; served with a chat
    /// template that prints tools and tool calls (Qwen2.5's).
    Agent,
    /// Short chat-like prompts (--short-tokens, continuing --conversations conversations) mixed
    /// with long documents (--long-fraction of the requests, --doc-tokens, --docs distinct
    /// documents, each re-asked), Poisson at --rate.
    Mixed,
}

/// `--apis`: how session workloads are sent.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
enum ApiArg {
    /// OpenAI chat completions.
    Chat,
    /// Anthropic Messages.
    Messages,
}

impl From<ApiArg> for Api {
    fn from(a: ApiArg) -> Api {
        match a {
            ApiArg::Chat => Api::Chat,
            ApiArg::Messages => Api::Messages,
        }
    }
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
enum Prompts {
    /// Token-id prompts.
    Ids,
    /// Text prompts (every router accepts them; SMG refuses token ids).
    Text,
}

/// `A-B`: an inclusive range of token counts.
fn token_range(s: &str) -> Result<(usize, usize), String> {
    let (a, b) = s.split_once('-').ok_or_else(|| format!("{s:?}: expected MIN-MAX"))?;
    let (a, b): (usize, usize) = (a.trim().parse().map_err(|e| format!("{a:?}: {e}"))?, b.trim().parse().map_err(|e| format!("{b:?}: {e}"))?);
    if a == 0 || a > b {
        return Err(format!("{s:?}: expected 0 < MIN <= MAX"));
    }
    Ok((a, b))
}

#[derive(Args, Clone)]
struct Common {
    /// `model` of the requests.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// What to send.
    #[arg(long, value_enum, default_value = "trace")]
    workload: Kind,
    /// trace: the Mooncake trace.
    #[arg(long, default_value = "benches/traces/mooncake_synthetic_trace.jsonl")]
    trace: PathBuf,
    /// trace: arrivals this many times faster.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// trace / shared-prefix / mixed: at most this many requests.
    #[arg(long, default_value_t = usize::MAX)]
    max_requests: usize,
    /// trace: prompts cut to this many tokens (a prefix, so sharing is kept).
    #[arg(long, default_value_t = 16_384)]
    max_isl: usize,
    /// trace: outputs cut to this many tokens.
    #[arg(long, default_value_t = 1024)]
    max_osl: usize,
    /// Token ids are drawn below this (the target's vocabulary size).
    #[arg(long, default_value_t = 4000)]
    vocab: u32,
    /// shared-prefix / mixed / trace: token-id or text prompts (a text prompt of n tokens is
    /// n words that are one token each in vllm-sim's built-in tokenizer; SMG takes only text).
    /// Default text, but ids for the trace (its recorded figures were taken with ids). Chat
    /// and agent are text.
    #[arg(long, value_enum)]
    prompts: Option<Prompts>,
    /// shared-prefix / chat / agent / mixed: seed of the texts, ids and arrivals.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// shared-prefix: prefixes.
    #[arg(long, default_value_t = 32)]
    groups: u32,
    /// shared-prefix: prefix length, tokens.
    #[arg(long, default_value_t = 384)]
    prefix_tokens: usize,
    /// shared-prefix: unique suffix length, tokens.
    #[arg(long, default_value_t = 128)]
    suffix_tokens: usize,
    /// mixed: fraction of requests that are long documents.
    #[arg(long, default_value_t = 0.2)]
    long_fraction: f64,
    /// mixed: short prompts' length, tokens (MIN-MAX).
    #[arg(long, default_value = "100-500", value_parser = token_range)]
    short_tokens: (usize, usize),
    /// mixed: conversations the short prompts continue (each prompt extends its
    /// conversation's previous one, until it would outgrow --short-tokens).
    #[arg(long, default_value_t = 32)]
    conversations: usize,
    /// mixed: documents' length, tokens (MIN-MAX), question included.
    #[arg(long, default_value = "4096-16384", value_parser = token_range)]
    doc_tokens: (usize, usize),
    /// mixed: distinct documents (questions pick one uniformly, so each is re-asked; the
    /// default 48 average 480k tokens, more than one default worker's KV cache holds).
    #[arg(long, default_value_t = 48)]
    docs: u32,
    /// shared-prefix / chat / agent / mixed: output tokens per request.
    #[arg(long, default_value_t = 64)]
    output_tokens: u32,
    /// shared-prefix / mixed: requests (chat / agent: sessions).
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// shared-prefix / mixed: requests per second (chat / agent: sessions started per second).
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// chat / agent: turns per session.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// chat / agent: pause between an answer and the next turn, ms.
    #[arg(long, default_value_t = 500)]
    think_ms: u64,
    /// chat / agent: the APIs the sessions are sent as, comma-separated (chat, messages); each
    /// is a run of its own (compare: on a fresh cluster), in this order for every target.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "chat")]
    apis: Vec<ApiArg>,
    /// agent: tokens of the shared system prompt, before the tools.
    #[arg(long, default_value_t = 2000)]
    system_tokens: usize,
    /// agent: tools offered (shared by every session).
    #[arg(long, default_value_t = 12)]
    tools: usize,
    /// agent: tokens of a tool result (each between half and 1.5 times this).
    #[arg(long, default_value_t = 300)]
    tool_result_tokens: usize,
    /// Goodput SLO: time to first token, ms.
    #[arg(long, default_value_t = 2000.0)]
    slo_ttft_ms: f64,
    /// Goodput SLO: mean inter-token latency, ms.
    #[arg(long, default_value_t = 100.0)]
    slo_itl_ms: f64,
    /// compare: give kvgate targets the goodput SLO as their model's latency objectives
    /// (`slo: {ttft_ms, tpot_ms}`), so they route to meet it.
    #[arg(long)]
    kvgate_slo: bool,
    /// Output folder for results.json, results.md and ttft_cdf.svg.
    #[arg(long, default_value = "benches/out/latest")]
    out: PathBuf,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

impl Common {
    /// The prompt format: `--prompts`, or the workload's default.
    fn format(&self) -> Result<workload::PromptFormat, String> {
        let p = match (self.workload, self.prompts) {
            (Kind::Chat | Kind::Agent, Some(Prompts::Ids)) => return Err("--prompts ids: the chat and agent workloads send text".into()),
            (Kind::Trace, p) => p.unwrap_or(Prompts::Ids),
            (_, p) => p.unwrap_or(Prompts::Text),
        };
        Ok(if p == Prompts::Ids { workload::PromptFormat::Ids } else { workload::PromptFormat::Text })
    }

    /// The APIs sessions are sent as; Messages only for the session workloads.
    fn apis(&self) -> Result<Vec<Api>, String> {
        let apis: Vec<Api> = self.apis.iter().map(|&a| a.into()).collect();
        if apis.is_empty() {
            return Err("--apis: name at least one".into());
        }
        if !matches!(self.workload, Kind::Chat | Kind::Agent) && apis != [Api::Chat] {
            return Err("--apis: only the chat and agent workloads are sent as Messages (the others send their own paths)".into());
        }
        Ok(apis)
    }

    /// For a trace workload, the floor and clairvoyant references of its requests on
    /// `workers` workers started with `sim_args` ([`trace_floor`]); `None` for the other
    /// workloads.
    fn trace_references(&self, sim_args: &[String], workers: usize) -> Option<Result<trace_floor::References, String>> {
        if !matches!(self.workload, Kind::Trace) {
            return None;
        }
        Some((|| {
            let args = vllm_sim::SimArgs::try_parse_from(std::iter::once("vllm-sim".to_string()).chain(sim_args.iter().cloned()))
                .map_err(|e| format!("--sim-args: {e}"))?;
            let cfg = args.into_config()?;
            let engine =
                trace_floor::Engine { timing: cfg.timing, chunk_tokens: cfg.max_num_batched_tokens, block_size: cfg.block_size, time_scale: cfg.time_scale };
            let t = trace::load(&self.trace)?;
            let t = &t[..t.len().min(self.max_requests)];
            if t.is_empty() {
                return Err(format!("{}: no requests to replay", self.trace.display()));
            }
            Ok(trace_floor::References::of(t, (self.max_isl, self.max_osl), &engine, workers, self.speedup))
        })())
    }

    fn workload(&self) -> Result<(Workload, String), String> {
        self.workload_as(self.format()?)
    }

    /// The workload with its prompts in `format` (the same requests either way: a text prompt
    /// has its id form's tokens on the workers).
    fn workload_as(&self, format: workload::PromptFormat) -> Result<(Workload, String), String> {
        let as_text = |f| if f == workload::PromptFormat::Text { "text" } else { "token-id" };
        Ok(match self.workload {
            Kind::Trace => {
                let t = trace::load(&self.trace)?;
                let w = workload::from_trace(&t, format, self.speedup, (self.max_requests, self.max_isl, self.max_osl), self.vocab);
                let note = format!(
                    "Workload: {} requests of {} replayed at {}x speed as {} prompts (cut to {} tokens, outputs to {}).",
                    w.len(),
                    self.trace.display(),
                    self.speedup,
                    as_text(format),
                    self.max_isl,
                    self.max_osl
                );
                (w, note)
            }
            Kind::SharedPrefix => {
                let n = self.requests.min(self.max_requests);
                let w = workload::shared_prefix(workload::SharedPrefix {
                    format,
                    groups: self.groups,
                    prefix_tokens: self.prefix_tokens,
                    suffix_tokens: self.suffix_tokens,
                    output_tokens: self.output_tokens as usize,
                    requests: n,
                    rate: self.rate,
                    vocab: self.vocab,
                    seed: self.seed,
                });
                let note = format!(
                    "Workload: {n} {} requests over {} shared prefixes of {} tokens (+{} unique), {} output tokens, {}/s Poisson, seed {}.",
                    as_text(format),
                    self.groups,
                    self.prefix_tokens,
                    self.suffix_tokens,
                    self.output_tokens,
                    self.rate,
                    self.seed
                );
                (w, note)
            }
            Kind::Mixed => {
                let n = self.requests.min(self.max_requests);
                let m = workload::Mixed {
                    format,
                    requests: n,
                    rate: self.rate,
                    long_fraction: self.long_fraction.clamp(0.0, 1.0),
                    short_tokens: self.short_tokens,
                    conversations: self.conversations,
                    doc_tokens: self.doc_tokens,
                    docs: self.docs,
                    output_tokens: self.output_tokens as usize,
                    vocab: self.vocab,
                    seed: self.seed,
                };
                let note = format!(
                    "Workload: {n} {} requests, {}/s Poisson, seed {}: {:.0}% short prompts of {}-{} tokens continuing {} conversations, {:.0}% questions about {} documents of {}-{} tokens; {} output tokens.",
                    as_text(format),
                    self.rate,
                    self.seed,
                    100.0 * (1.0 - m.long_fraction),
                    m.short_tokens.0,
                    m.short_tokens.1,
                    m.conversations,
                    100.0 * m.long_fraction,
                    m.docs,
                    m.doc_tokens.0,
                    m.doc_tokens.1,
                    self.output_tokens
                );
                (workload::mixed(m), note)
            }
            Kind::Chat => {
                let w = workload::chat_sessions(workload::ChatSessions {
                    sessions: self.requests,
                    turns: self.turns,
                    words_per_turn: 40,
                    system_words: 200,
                    output_tokens: self.output_tokens,
                    rate: self.rate,
                    think: Duration::from_millis(self.think_ms),
                    seed: self.seed,
                });
                let note = format!("Workload: {} chat sessions of {} turns, {} sessions/s.", self.requests, self.turns, self.rate);
                (w, note)
            }
            Kind::Agent => {
                let a = workload::AgentSessions {
                    sessions: self.requests,
                    turns: self.turns,
                    system_tokens: self.system_tokens,
                    tools: self.tools,
                    user_tokens: 60,
                    tool_result_tokens: self.tool_result_tokens,
                    user_every: 4,
                    output_tokens: self.output_tokens,
                    rate: self.rate,
                    think: Duration::from_millis(self.think_ms),
                    seed: self.seed,
                };
                let note = format!(
                    "Workload: {} agent sessions of {} turns, {} sessions/s, seed {}: a shared system prompt of {} tokens and {} tools, a task of 60 tokens, then tool results of {}-{} tokens after a tool call appended to each answer (a 60-token user follow-up every 4th turn), {} output tokens, {} ms think time.",
                    a.sessions,
                    a.turns,
                    a.rate,
                    a.seed,
                    a.system_tokens,
                    a.tools,
                    a.tool_result_tokens / 2,
                    a.tool_result_tokens / 2 + a.tool_result_tokens,
                    a.output_tokens,
                    self.think_ms
                );
                (workload::agent_sessions(a), note)
            }
        })
    }

    fn slo(&self) -> Slo {
        Slo { ttft_ms: self.slo_ttft_ms, itl_ms: self.slo_itl_ms }
    }
}

fn finish(reports: &[Report], common: &Common, note: &str) {
    println!("{note}\n\n{}", report::markdown(reports));
    match report::write(&common.out, reports, note) {
        Ok(()) => println!("written: {0}/results.json, {0}/results.md, {0}/ttft_cdf.svg", common.out.display()),
        Err(e) => eprintln!("kvgate-bench: cannot write {}: {e}", common.out.display()),
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Run { url, label, workers, common } => match common.workload().and_then(|w| Ok((w, common.apis()?))) {
            Ok(((w, note), apis)) => {
                let mut reports = Vec::new();
                let mut runs = Vec::new();
                for &api in &apis {
                    let o = RunOptions {
                        label: if apis.len() > 1 { format!("{label} {}", api.name()) } else { label.clone() },
                        url: url.trim_end_matches('/').to_string(),
                        model: common.model.clone(),
                        worker_urls: workers.clone(),
                        slo: common.slo(),
                        progress: !common.quiet,
                        api,
                        spread: None,
                    };
                    reports.push(run(&o, &w).await);
                    runs.push((label.clone(), api));
                }
                let note = match by_api(&runs, &reports) {
                    Some(t) => format!("{note}\n\n{t}"),
                    None => note,
                };
                finish(&reports, &common, &note);
                0
            }
            Err(e) => {
                eprintln!("kvgate-bench: {e}");
                2
            }
        },
        Cmd::Compare { workers, targets, sim_bin, kvgate_bin, sim_args, kvgate_routing, vllm_router_bin, smg_bin, warm, common } => {
            let peers = Peers { vllm_router: cluster::which(&vllm_router_bin), smg: cluster::which(&smg_bin), warm };
            compare(workers, &targets, &sim_bin, &kvgate_bin, &sim_args, &kvgate_routing, &peers, &common).await
        }
        Cmd::Reschedule(a) => reschedule(a).await,
        Cmd::Planner(a) => planner(a).await,
        Cmd::Connections(a) => connections(a).await,
        Cmd::Soak(a) => soak(a).await,
        Cmd::Overload(a) => overload(a).await,
        Cmd::Tenants(a) => tenants(a).await,
        Cmd::Replicas { workers, replicas, cases, sim_bin, kvgate_bin, sim_args, common } => {
            replicas_cmd(workers, replicas, &cases, (&sim_bin, &kvgate_bin, &sim_args), &common).await
        }
        Cmd::Disagg(a) => disagg(a).await,
    };
    std::process::exit(code);
}

struct Peers {
    vllm_router: Option<PathBuf>,
    smg: Option<PathBuf>,
    /// `--warm`: requests sent to every worker before measuring.
    warm: usize,
}

#[allow(clippy::too_many_arguments)]
async fn compare(n: usize, targets: &[String], sim_bin: &Path, kvgate_bin: &Path, sim_args: &str, kvgate_routing: &str, peers: &Peers, common: &Common) -> i32 {
    let ((w, note), apis) = match common.workload().and_then(|w| Ok((w, common.apis()?))) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("kvgate-bench: {e}");
            return 2;
        }
    };
    // Every target is checked before anything starts.
    let mut parsed = Vec::with_capacity(targets.len());
    for t in targets {
        match Peer::parse(t) {
            Ok(p) => parsed.push(p),
            Err(e) => {
                eprintln!("kvgate-bench: {e}");
                return 2;
            }
        }
    }
    let warm_jobs = match warm_jobs(common, peers.warm) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("kvgate-bench: {e}");
            return 2;
        }
    };
    // A target that refuses token ids (SMG) is sent the same prompts as text, in the same run.
    let text_form = match common.format() {
        Ok(workload::PromptFormat::Ids) if parsed.iter().flatten().any(Peer::refuses_token_ids) => match common.workload_as(workload::PromptFormat::Text) {
            Ok((w, _)) => Some(w),
            Err(e) => {
                eprintln!("kvgate-bench: {e}");
                return 2;
            }
        },
        _ => None,
    };
    let mut base =
        SimOptions { bin: sim_bin.to_path_buf(), model: common.model.clone(), args: sim_args.split_whitespace().map(String::from).collect(), env: Vec::new() };
    let mut reports = Vec::new();
    let mut runs = Vec::new();
    let fresh = if apis.len() > 1 { "fresh for every target and API" } else { "fresh for every target" };
    let mut notes = vec![note, format!("Cluster: {n} vllm-sim workers ({}), {fresh}.", if sim_args.is_empty() { "defaults" } else { sim_args })];
    let references = match common.trace_references(&base.args, n) {
        Some(Ok(r)) => {
            notes.push(r.note(n));
            Some(r)
        }
        Some(Err(e)) => {
            eprintln!("kvgate-bench: {e}");
            return 2;
        }
        None => None,
    };
    // The workers' own tokenizer (vllm-sim's built-in one), so text prompts hash to the blocks
    // the workers cache; the agent workload's adds a chat template that prints tools, written
    // next to the results and given to the workers and kvgate alike.
    let mut kvgate_tokenizer = "tokenizer: builtin".to_string();
    if matches!(common.workload, Kind::Agent) {
        let dir = common.out.join("tokenizer");
        match workload::write_agent_tokenizer(&dir).and_then(|()| dir.canonicalize()) {
            Ok(dir) => {
                base.args.extend(["--tokenizer".to_string(), dir.display().to_string()]);
                kvgate_tokenizer = format!("tokenizer: {}", dir.display());
                notes.push(format!("Workers and kvgate: --tokenizer / tokenizer: {} (vllm-sim's built-in tokenizer, Qwen2.5's chat template).", dir.display()));
            }
            Err(e) => {
                eprintln!("kvgate-bench: cannot write the agent tokenizer into {}: {e}", dir.display());
                return 1;
            }
        }
    }
    if common.kvgate_slo {
        let _ = write!(kvgate_tokenizer, "\nslo: {{ttft_ms: {}, tpot_ms: {}}}", common.slo_ttft_ms, common.slo_itl_ms);
        notes.push(format!("kvgate targets route with slo: {{ttft_ms: {}, tpot_ms: {}}}.", common.slo_ttft_ms, common.slo_itl_ms));
    }
    let logs = common.out.join("logs");
    for ((t, peer), &api) in targets.iter().zip(&parsed).flat_map(|tp| apis.iter().map(move |a| (tp, a))) {
        let label = if apis.len() > 1 { format!("{t} {}", api.name()) } else { t.clone() };
        let mut procs = Procs::default();
        // The workers as this target needs them (vllm-router kv_aware: full 32-byte hashes).
        let mut sims = base.clone();
        if let Some(p) = peer {
            sims.env.extend(p.worker_env());
            sims.args.extend(p.worker_args());
            if !p.worker_env().is_empty() || !p.worker_args().is_empty() {
                let env: Vec<String> = p.worker_env().iter().map(|(k, v)| format!("{k}={v}")).collect();
                notes.push(format!("{t}: workers run with {} {}.", env.join(" "), p.worker_args().join(" ")));
            }
        }
        let workers = match cluster::start_sims(&mut procs, &sims, n).await {
            Ok(w) => w,
            Err(e) => {
                eprintln!("kvgate-bench: {e}");
                return 1;
            }
        };
        let started = match peer {
            None => {
                // `kvgate-kv@overlap_score_weight=4;temperature=0.1`: per-target routing keys.
                let (name, keys) = t.split_once('@').unwrap_or((t.as_str(), ""));
                let mode = name.trim_start_matches("kvgate-");
                let mut routing = format!("mode: {mode}");
                let extra = if keys.is_empty() && mode == "kv" { kvgate_routing.to_string() } else { keys.replace('=', ": ") };
                for line in extra.split(';').filter(|l| !l.trim().is_empty()) {
                    routing.push('\n');
                    routing.push_str(line.trim());
                }
                // Its output, at the level KVGATE_LOG names (warnings only when unset).
                let log = match target_log(&logs, t) {
                    Ok(log) => log,
                    Err(e) => {
                        eprintln!("kvgate-bench: {}: {e}", logs.display());
                        return 1;
                    }
                };
                cluster::start_kvgate(&mut procs, kvgate_bin, (&common.model, &routing, &kvgate_tokenizer), &workers, Some(&log))
                    .await
                    .map(|g| Some((g.url, Metrics::Gateway(g.admin))))
            }
            Some(p) => start_peer(&mut procs, t, p, peers, &common.model, &workers, peers::block_size(&sims.args), &logs).await.map(|o| {
                o.map(|(url, prom, line)| {
                    notes.push(format!("{t}: `{line}`"));
                    (url, Metrics::Peer(prom))
                })
            }),
        };
        let (url, prom) = match started {
            Ok(Some(x)) => x,
            Ok(None) => {
                notes.push(format!("{t}: skipped (not installed)."));
                eprintln!("kvgate-bench: {t} skipped: not installed");
                continue;
            }
            Err(e) => {
                notes.push(format!("{t}: did not start: {e}"));
                eprintln!("kvgate-bench: {t} did not start: {e}");
                continue;
            }
        };
        eprintln!("kvgate-bench: {label} at {url}");
        if !warm_jobs.is_empty() {
            warm(&warm_jobs, &common.model, &workers).await;
        }
        let o = RunOptions {
            label: label.clone(),
            url,
            model: common.model.clone(),
            worker_urls: workers.iter().map(|w| w.url.clone()).collect(),
            slo: common.slo(),
            progress: !common.quiet,
            api,
            spread: None,
        };
        let jobs = match (&text_form, peer) {
            (Some(text), Some(p)) if p.refuses_token_ids() => {
                notes.push(format!("{t}: sent the same prompts as text (it refuses token ids; each word is one token on the workers)."));
                text
            }
            _ => &w,
        };
        reports.push(run(&o, jobs).await);
        runs.push((t.clone(), api));
        let lines = match (peer, &prom) {
            (Some(Peer { router: peers::Router::VllmRouter, policy, .. }), Metrics::Peer(prom)) if policy == "kv_aware" => vec![kv_lookups(prom).await],
            (None, Metrics::Gateway(admin)) => vec![decision_times(admin, &common.model).await, gateway_counts(admin, &common.model).await],
            _ => Vec::new(),
        };
        for line in lines.into_iter().flatten() {
            eprintln!("kvgate-bench: {label}: {line}");
            notes.push(format!("{label}: {line}"));
        }
        drop(procs);
    }
    if let Some(t) = by_api(&runs, &reports) {
        notes.push(t);
    }
    // Beside the peers, what routing could get: a figure level with the best peer's may still
    // be far from what a router knowing every queue gets.
    if let Some(refs) = &references {
        for r in &reports {
            if let Some(line) = refs.distance(&r.label, &trace_floor::Figures::from_quantiles(&r.ttft_ms, &r.tpot_ms, &r.e2e_ms)) {
                eprintln!("kvgate-bench: {line}");
                notes.push(line);
            }
        }
    }
    finish(&reports, common, &notes.join("\n"));
    0
}

/// `kvgate-bench replicas` (`kvgate_bench::replicas`).
async fn replicas_cmd(workers: usize, n: usize, cases: &[String], (sim_bin, kvgate_bin, sim_args): (&Path, &Path, &str), common: &Common) -> i32 {
    let parsed: Result<Vec<replicas::Case>, String> = cases.iter().map(|c| replicas::Case::parse(c)).collect();
    let ((w, note), api, cases) = match common.workload().and_then(|w| Ok((w, common.apis()?, parsed?))) {
        Ok((w, apis, cases)) => (w, apis[0], cases),
        Err(e) => {
            eprintln!("kvgate-bench: {e}");
            return 2;
        }
    };
    let logs = common.out.join("logs");
    if let Err(e) = std::fs::create_dir_all(&logs) {
        eprintln!("kvgate-bench: {}: {e}", logs.display());
        return 1;
    }
    let sims =
        SimOptions { bin: sim_bin.to_path_buf(), model: common.model.clone(), args: sim_args.split_whitespace().map(String::from).collect(), env: Vec::new() };
    let o = replicas::Options {
        workers,
        replicas: n,
        sims,
        kvgate_bin: kvgate_bin.to_path_buf(),
        model: common.model.clone(),
        model_extra: "tokenizer: builtin".into(),
        slo: common.slo(),
        progress: !common.quiet,
        api,
        logs,
    };
    let halfway = match &w {
        Workload::Open(jobs) => jobs.last().map_or(Duration::from_secs(10), |j| j.at / 2),
        Workload::Sessions(s) => s.iter().map(|s| s.start).max().unwrap_or_default() / 2 + Duration::from_secs(1),
    };
    match replicas::run_cases(&o, &cases, &w, halfway).await {
        Ok((reports, notes)) => {
            let mut all = vec![
                note,
                format!(
                    "{workers} vllm-sim workers ({}), fresh for every case; requests spread at random over the replicas.",
                    if sim_args.is_empty() { "defaults" } else { sim_args }
                ),
            ];
            all.extend(notes);
            finish(&reports, common, &all.join("\n"));
            0
        }
        Err(e) => {
            eprintln!("kvgate-bench: {e}");
            1
        }
    }
}

/// kvgate's own counts after a run: its requests by endpoint and status, the Messages and
/// Responses prompts it could not render and routed by load alone
/// (`kvgate_render_fallback_total`), how the requests spread over the workers
/// (`kvgate_routing_decisions_total`), how many prompt blocks the chosen worker held
/// (`kvgate_routing_overlap_blocks`, kv mode), and how many requests the router queue held and
/// how long (`kvgate_queue_wait_seconds`).
async fn gateway_counts(admin: &str, model: &str) -> Option<String> {
    let text = reqwest::get(format!("{admin}/metrics")).await.ok()?.text().await.ok()?;
    let m = kvgate_tests::prom::Metrics::parse(&text);
    let mut requests = std::collections::BTreeMap::<String, f64>::new();
    let mut fallbacks = std::collections::BTreeMap::<String, f64>::new();
    let mut per_worker: Vec<f64> = Vec::new();
    for s in &m.samples {
        let label = |k: &str| s.labels.get(k).cloned().unwrap_or_default();
        match s.name.as_str() {
            "kvgate_requests_total" if label("model") == model => *requests.entry(format!("{} {}", label("endpoint"), label("status"))).or_default() += s.value,
            "kvgate_render_fallback_total" => *fallbacks.entry(format!("{} {}", label("endpoint"), label("reason"))).or_default() += s.value,
            "kvgate_routing_decisions_total" if label("model") == model => per_worker.push(s.value),
            _ => {}
        }
    }
    let list = |map: &std::collections::BTreeMap<String, f64>| {
        let l: Vec<String> = map.iter().filter(|(_, v)| **v > 0.0).map(|(k, v)| format!("{k}: {v}")).collect();
        if l.is_empty() { "none".to_string() } else { l.join(", ") }
    };
    let name = "kvgate_routing_overlap_blocks";
    let decisions = m.sum(&format!("{name}_count"), &[("model", model)]);
    let overlap = if decisions > 0.0 {
        format!(
            "; prompt blocks cached on the chosen worker ({name}): mean {:.1} over {decisions} decisions",
            m.sum(&format!("{name}_sum"), &[("model", model)]) / decisions
        )
    } else {
        String::new()
    };
    let name = "kvgate_queue_wait_seconds";
    let held = m.sum(&format!("{name}_count"), &[("model", model)]);
    let queue = if held > 0.0 {
        format!("; held in the router queue ({name}): {held} requests, mean wait {:.1} ms", m.sum(&format!("{name}_sum"), &[("model", model)]) / held * 1000.0)
    } else {
        format!("; held in the router queue ({name}): none")
    };
    per_worker.sort_by(|a, b| b.total_cmp(a));
    let spread = if per_worker.is_empty() {
        String::new()
    } else {
        let counts: Vec<String> = per_worker.iter().map(|v| v.to_string()).collect();
        format!("; requests per worker, most first (kvgate_routing_decisions_total): {}", counts.join(" / "))
    };
    Some(format!(
        "requests by endpoint and status (kvgate_requests_total): {}; render fallbacks (kvgate_render_fallback_total): {}{spread}{overlap}{queue}",
        list(&requests),
        list(&fallbacks)
    ))
}

/// The session workloads' comparison across APIs, when a run names a `kvgate-round_robin`
/// target or more than one API: per API and target the hit rate and TTFT p50 / p99, against
/// round_robin's on the same API (its TTFT ÷ this one's: above 1 is faster than round_robin),
/// and per target Messages against chat.
fn by_api(runs: &[(String, Api)], reports: &[Report]) -> Option<String> {
    let apis: Vec<Api> = runs.iter().map(|r| r.1).fold(Vec::new(), |mut v, a| {
        if !v.contains(&a) {
            v.push(a);
        }
        v
    });
    let baseline = |api: Api| runs.iter().zip(reports).find(|((t, a), _)| *a == api && t == "kvgate-round_robin").map(|(_, r)| r);
    if apis.len() < 2 && apis.iter().all(|&a| baseline(a).is_none()) {
        return None;
    }
    let hit = |r: &Report| r.hit_rate.map_or("n/a".into(), |h| format!("{h:.3}"));
    let ratio = |a: f64, b: f64| if b > 0.0 { format!("{:.2}×", a / b) } else { "n/a".into() };
    let mut t = String::from(
        "By API (TTFT vs round_robin: round_robin's ÷ this target's, on the same API):\n\n| API | target | ok | hit rate | TTFT p50 | TTFT p99 | hit rate − round_robin's | TTFT p50 vs round_robin | TTFT p99 vs round_robin |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for &api in &apis {
        let base = baseline(api);
        for ((target, _), r) in runs.iter().zip(reports).filter(|((_, a), _)| *a == api) {
            let (dh, p50, p99) = match base {
                Some(b) if !std::ptr::eq(b, r) => (
                    match (r.hit_rate, b.hit_rate) {
                        (Some(x), Some(y)) => format!("{:+.3}", x - y),
                        _ => "n/a".into(),
                    },
                    ratio(b.ttft_ms.p50, r.ttft_ms.p50),
                    ratio(b.ttft_ms.p99, r.ttft_ms.p99),
                ),
                _ => ("".into(), "".into(), "".into()),
            };
            let _ = writeln!(
                t,
                "| {} | {target} | {}/{} | {} | {:.0} ms | {:.0} ms | {dh} | {p50} | {p99} |",
                api.name(),
                r.ok,
                r.requests,
                hit(r),
                r.ttft_ms.p50,
                r.ttft_ms.p99
            );
        }
    }
    if apis.contains(&Api::Chat) && apis.contains(&Api::Messages) {
        t.push_str("\nMessages against chat, same target:\n\n| target | hit rate, messages − chat | TTFT p50, messages ÷ chat | TTFT p99, messages ÷ chat |\n|---|---:|---:|---:|\n");
        for ((target, _), m) in runs.iter().zip(reports).filter(|((_, a), _)| *a == Api::Messages) {
            let Some(c) = runs.iter().zip(reports).find(|((t, a), _)| t == target && *a == Api::Chat).map(|(_, r)| r) else { continue };
            let dh = match (m.hit_rate, c.hit_rate) {
                (Some(x), Some(y)) => format!("{:+.3}", x - y),
                _ => "n/a".into(),
            };
            let _ = writeln!(t, "| {target} | {dh} | {} | {} |", ratio(m.ttft_ms.p50, c.ttft_ms.p50), ratio(m.ttft_ms.p99, c.ttft_ms.p99));
        }
    }
    Some(t)
}

/// The first `n` requests of `common`'s workload with the next seed (other unique parts, the
/// same shared prefixes), each asking for one token: what `--warm` sends every worker.
fn warm_jobs(common: &Common, n: usize) -> Result<Vec<(&'static str, serde_json::Value)>, String> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if !matches!(common.workload, Kind::SharedPrefix) {
        return Err("--warm needs --workload shared-prefix (the workload whose shared prefixes do not depend on the seed)".into());
    }
    let next = Common { seed: common.seed.wrapping_add(1), ..common.clone() };
    let Workload::Open(jobs) = next.workload()?.0 else { return Err("shared-prefix is open-loop".into()) };
    Ok(jobs
        .into_iter()
        .take(n)
        .map(|j| {
            let mut body = j.body;
            body["model"] = serde_json::json!(common.model);
            body["max_tokens"] = serde_json::json!(1);
            body["stream"] = serde_json::json!(false);
            // vLLM refuses stream options on a request that does not stream.
            if let Some(o) = body.as_object_mut() {
                o.remove("stream_options");
            }
            (j.path, body)
        })
        .collect())
}

/// Sends `jobs` to every worker directly, 64 at a time (each worker batches them), and waits
/// for the answers; a failed one only weakens the warm-up, so it is reported, not fatal.
async fn warm(jobs: &[(&'static str, serde_json::Value)], model: &str, workers: &[cluster::SimWorker]) {
    use futures_util::StreamExt;
    let Ok(http) = reqwest::Client::builder().timeout(Duration::from_secs(120)).build() else { return };
    let sends = workers.iter().flat_map(|w| jobs.iter().map(move |(path, body)| (format!("{}{path}", w.url), body)));
    let results: Vec<bool> = futures_util::stream::iter(sends.map(|(url, body)| {
        let http = http.clone();
        async move {
            match http.post(url).json(body).send().await {
                Ok(r) if r.status().is_success() => true,
                Ok(r) => {
                    eprintln!("kvgate-bench: warm-up request: {} {}", r.status(), r.text().await.unwrap_or_default());
                    false
                }
                Err(e) => {
                    eprintln!("kvgate-bench: warm-up request: {e}");
                    false
                }
            }
        }
    }))
    .buffer_unordered(64)
    .collect()
    .await;
    let failed = results.iter().filter(|ok| !**ok).count();
    eprintln!("kvgate-bench: warmed {} workers with {} requests each ({failed} failed, model {model})", workers.len(), jobs.len());
}

/// Where a started target exposes its Prometheus metrics.
enum Metrics {
    /// kvgate's admin listener.
    Gateway(String),
    /// A peer router's Prometheus port.
    Peer(String),
}

/// How long kvgate's routing decisions took under the run's load, from its own
/// `kvgate_routing_decision_seconds` histogram (tokenization excluded; `None` outside kv
/// mode, where it is not observed).
async fn decision_times(admin: &str, model: &str) -> Option<String> {
    let text = reqwest::get(format!("{admin}/metrics")).await.ok()?.text().await.ok()?;
    let m = kvgate_tests::prom::Metrics::parse(&text);
    let name = "kvgate_routing_decision_seconds";
    let total = m.sum(&format!("{name}_count"), &[("model", model)]);
    if total <= 0.0 {
        return None;
    }
    let mean_us = m.sum(&format!("{name}_sum"), &[("model", model)]) / total * 1e6;
    let within: Vec<String> = ["5e-6", "1e-5", "2e-5"]
        .iter()
        .filter_map(|le| {
            let s = m.samples.iter().find(|s| {
                s.name == format!("{name}_bucket")
                    && s.labels.get("model").is_some_and(|v| v == model)
                    && s.labels.get("le").and_then(|v| v.parse::<f64>().ok()) == le.parse::<f64>().ok()
            })?;
            Some(format!("≤ {} µs {:.2}%", le.parse::<f64>().ok()? * 1e6, s.value / total * 100.0))
        })
        .collect();
    Some(format!("routing decisions ({name}): {total} decisions, mean {mean_us:.2} µs, {}", within.join(", ")))
}

/// vllm-router's own count of KV placement lookups by result, read from its Prometheus port.
async fn kv_lookups(prom: &str) -> Option<String> {
    let text = reqwest::get(format!("{prom}/metrics")).await.ok()?.text().await.ok()?;
    let m = kvgate_tests::prom::Metrics::parse(&text);
    let mut by: Vec<(String, f64)> = Vec::new();
    for s in m.samples.iter().filter(|s| s.name == "vllm_router_kv_placement_lookups_total") {
        by.push((s.labels.get("result").cloned().unwrap_or_default(), s.value));
    }
    by.sort_by(|a, b| a.0.cmp(&b.0));
    let list: Vec<String> = by.iter().map(|(r, v)| format!("{r} {v}")).collect();
    Some(format!("KV placement lookups (vllm_router_kv_placement_lookups_total): {}", if list.is_empty() { "none".into() } else { list.join(", ") }))
}

/// Where a target's output goes, `logs/<target>.log`, with `logs` made if need be.
fn target_log(logs: &Path, target: &str) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(logs)?;
    Ok(logs.join(format!("{}.log", target.replace(['/', ' '], "_"))))
}

/// Starts a peer router; `Ok(None)` when it is not installed, else its URL, its Prometheus
/// URL and the command line it was started with.
///
/// vllm-router: `--policy <policy>`; kv_aware gets each worker's KV event and replay endpoints
/// (static sources, which subscribe to the topic "", vLLM's default), the workers' block size
/// and the model. SMG (sglang-router): `smg launch --policy …`. Both expose their own
/// Prometheus port, given a free one so they do not clash on their default. The peer's output
/// goes to `logs/<target>.log`.
#[allow(clippy::too_many_arguments)]
async fn start_peer(
    procs: &mut Procs,
    target: &str,
    peer: &Peer,
    peers: &Peers,
    model: &str,
    workers: &[cluster::SimWorker],
    block_size: usize,
    logs: &Path,
) -> Result<Option<(String, String, String)>, String> {
    let ports = cluster::ports_for_peers(2);
    let (port, prom) = (ports[0].to_string(), ports[1].to_string());
    let urls: Vec<&str> = workers.iter().map(|w| w.url.as_str()).collect();
    let (bin, mut args): (&PathBuf, Vec<String>) = match peer.router {
        peers::Router::VllmRouter => {
            let Some(bin) = &peers.vllm_router else { return Ok(None) };
            (bin, vec![])
        }
        peers::Router::Smg => {
            let Some(bin) = &peers.smg else { return Ok(None) };
            (bin, vec!["launch".into(), "--prometheus-host".into(), "127.0.0.1".into()])
        }
    };
    args.extend(["--host", "127.0.0.1", "--port", &port, "--prometheus-port", &prom, "--policy", &peer.policy, "--worker-urls"].map(String::from));
    args.extend(urls.iter().map(|u| u.to_string()));
    if peer.router == peers::Router::VllmRouter && peer.policy == "kv_aware" {
        for w in workers {
            args.extend(["--kv-event-source".into(), format!("{}={}", w.url, w.kv_events)]);
            args.extend(["--kv-event-replay-source".into(), format!("{}={}", w.url, w.replay)]);
        }
        args.extend(["--kv-event-block-size".into(), block_size.to_string(), "--kv-event-model".into(), model.to_string()]);
    }
    args.extend(peer.args.iter().cloned());
    let line = format!("{} {}", bin.file_name().map(|f| f.to_string_lossy()).unwrap_or_default(), args.join(" "));
    let mut cmd = std::process::Command::new(bin);
    cmd.args(&args).stdout(std::process::Stdio::null());
    let log = target_log(logs, target).and_then(std::fs::File::create);
    cmd.stderr(match log {
        Ok(f) => std::process::Stdio::from(f),
        Err(_) => std::process::Stdio::null(),
    });
    procs.0.push(cmd.spawn().map_err(|e| format!("{target}: {e}"))?);
    let url = format!("http://127.0.0.1:{port}");
    // Routers register workers after they start listening: ready once a request goes through.
    let http = reqwest::Client::new();
    // A text prompt: every router accepts it (SMG refuses token-id prompts; the workload's own
    // requests then fail and are counted as errors).
    let probe = serde_json::json!({"model": model, "prompt": "ready?", "max_tokens": 1});
    let start = std::time::Instant::now();
    let mut last = String::from("no answer");
    while start.elapsed() < Duration::from_secs(60) {
        match http.post(format!("{url}/v1/completions")).json(&probe).send().await {
            Ok(r) if r.status().is_success() => return Ok(Some((url, format!("http://127.0.0.1:{prom}"), line))),
            Ok(r) => {
                let status = r.status();
                let body = r.text().await.unwrap_or_default();
                last = format!("HTTP {status}: {}", body.chars().take(160).collect::<String>());
                // A client error will not go away by waiting (e.g. token-id prompts refused).
                if status.is_client_error() && start.elapsed() > Duration::from_secs(5) {
                    break;
                }
            }
            Err(_) => {}
        }
        if let Some(child) = procs.0.last_mut()
            && let Ok(Some(status)) = child.try_wait()
        {
            return Err(format!("{target} exited ({status}); see {}", logs.display()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(format!("{target} did not serve a completion (last answer: {last})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compare_format(args: &[&str]) -> Result<workload::PromptFormat, String> {
        let cli = Cli::try_parse_from(["kvgate-bench", "compare"].iter().chain(args)).map_err(|e| e.to_string())?;
        let Cmd::Compare { common, .. } = cli.cmd else { panic!("compare") };
        common.format()
    }

    #[test]
    fn the_trace_replays_token_ids_unless_text_is_asked_for() {
        assert_eq!(compare_format(&[]), Ok(workload::PromptFormat::Ids));
        assert_eq!(compare_format(&["--prompts", "text"]), Ok(workload::PromptFormat::Text));
        assert_eq!(compare_format(&["--workload", "shared-prefix"]), Ok(workload::PromptFormat::Text));
        assert!(compare_format(&["--workload", "chat", "--prompts", "ids"]).is_err());
    }
}
