//! `/metrics`: vLLM's Prometheus names, labels (`model_name`, `engine`) and histogram buckets
//! (docs/vllm-interface.md, "Prometheus metrics"), plus simulator extras under `vllm_sim:`.
//!
//! Each engine owns an [`EngineMetrics`] of atomics that only its task writes; the HTTP handler
//! renders all of them in the text exposition format.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

const TTFT_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0];
const ITL_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const E2E_BUCKETS: &[f64] = &[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0];

/// A lock-free histogram with fixed buckets.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    count: AtomicU64,
    sum_bits: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(), count: AtomicU64::new(0), sum_bits: AtomicU64::new(0) }
    }

    /// Records one observation.
    pub fn observe(&self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let _ = self.sum_bits.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| Some((f64::from_bits(b) + v).to_bits()));
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// A float gauge.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    /// Sets the value.
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }
    /// Reads the value.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// A monotonically increasing counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    /// Sets the value (for totals mirrored from the scheduler).
    pub fn store(&self, n: u64) {
        self.0.store(n, Ordering::Relaxed);
    }
    /// Reads the value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// One engine's metrics.
#[derive(Debug)]
pub struct EngineMetrics {
    /// `vllm:num_requests_running`.
    pub running: Gauge,
    /// `vllm:num_requests_waiting`.
    pub waiting: Gauge,
    /// `vllm:kv_cache_usage_perc`.
    pub kv_usage: Gauge,
    /// `vllm:prefix_cache_queries_total`.
    pub prefix_queries: Counter,
    /// `vllm:prefix_cache_hits_total`.
    pub prefix_hits: Counter,
    /// `vllm:num_preemptions_total`.
    pub preemptions: Counter,
    /// `vllm:prompt_tokens_total`.
    pub prompt_tokens: Counter,
    /// `vllm:generation_tokens_total`.
    pub generation_tokens: Counter,
    /// `vllm:request_success_total{finished_reason="stop"}`.
    pub success_stop: Counter,
    /// `...{finished_reason="length"}`.
    pub success_length: Counter,
    /// `...{finished_reason="error"}`: a failed KV pull under `kv_load_failure_policy: "fail"`.
    pub success_error: Counter,
    /// `vllm:prompt_tokens_by_source_total{source="local_compute"}`.
    pub prompt_local_compute: Counter,
    /// `...{source="local_cache_hit"}`.
    pub prompt_local_cache_hit: Counter,
    /// `...{source="external_kv_transfer"}`.
    pub prompt_external: Counter,
    /// `vllm_sim:kv_held_requests`: finished prefill legs whose blocks wait for a decode worker.
    pub held_requests: Gauge,
    /// `vllm_sim:aborted_requests_total`: requests aborted because the client went away.
    pub aborted: Counter,
    /// `vllm:admission_rejections_total`.
    pub admission_rejections: Counter,
    /// `vllm_sim:kv_events_batches_total`.
    pub event_batches: Counter,
    /// `vllm_sim:kv_events_dropped_total`: batches dropped because the publisher queue was full.
    pub event_batches_dropped: Counter,
    /// `vllm_sim:engine_steps_total`.
    pub steps: Counter,
    /// `vllm_sim:engine_lag_seconds_total`, in microseconds: wall time the engine fell behind
    /// its virtual clock and gave up catching up (the host ran it late), so every simulated
    /// step after it ran that much later than the timing model says.
    pub lag_us: Counter,
    /// `vllm:time_to_first_token_seconds`.
    pub ttft: Histogram,
    /// `vllm:inter_token_latency_seconds`.
    pub itl: Histogram,
    /// `vllm:e2e_request_latency_seconds`.
    pub e2e: Histogram,
    /// `vllm:request_queue_time_seconds`.
    pub queue_time: Histogram,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        Self {
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_usage: Gauge::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            preemptions: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            success_stop: Counter::default(),
            success_length: Counter::default(),
            success_error: Counter::default(),
            prompt_local_compute: Counter::default(),
            prompt_local_cache_hit: Counter::default(),
            prompt_external: Counter::default(),
            held_requests: Gauge::default(),
            aborted: Counter::default(),
            admission_rejections: Counter::default(),
            event_batches: Counter::default(),
            event_batches_dropped: Counter::default(),
            steps: Counter::default(),
            lag_us: Counter::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            queue_time: Histogram::new(E2E_BUCKETS),
        }
    }
}

impl EngineMetrics {
    /// Counts a request's prompt at its first token, as vLLM's `PromptTokenStats`
    /// (`vllm/v1/metrics/stats.py`): every prompt token once in `vllm:prompt_tokens_total`, and
    /// by source: computed here (`prompt - cached`, which includes the last token vLLM
    /// recomputes when all others were cached or pulled), pulled from a prefill worker, or hit
    /// in the local prefix cache (the rest).
    pub fn count_prompt(&self, out: &crate::scheduler::TokenOutput) {
        let (prompt, cached, external) = (out.num_prompt_tokens, out.num_cached_tokens, out.num_external_tokens);
        let recomputed = usize::from(cached + 1 == prompt);
        self.prompt_tokens.add(prompt as u64);
        self.prompt_local_compute.add(prompt.saturating_sub(cached) as u64);
        self.prompt_external.add(external as u64);
        self.prompt_local_cache_hit.add((cached + recomputed).saturating_sub(external) as u64);
    }
}

/// Static facts rendered in `vllm:cache_config_info`.
#[derive(Debug, Clone)]
pub struct CacheInfo {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks per engine.
    pub num_gpu_blocks: usize,
    /// Prefix caching on/off.
    pub enable_prefix_caching: bool,
}

/// Renders every engine's metrics in Prometheus text format.
pub fn render(model: &str, engines: &[&EngineMetrics], cache: &CacheInfo) -> String {
    let mut out = String::with_capacity(16 * 1024);
    let model = escape(model);
    let lbl = |e: usize| format!("engine=\"{e}\",model_name=\"{model}\"");

    // A series of one float per engine, of Prometheus type `kind`.
    let floats = |out: &mut String, kind: &str, name: &str, help: &str, get: &dyn Fn(&EngineMetrics) -> f64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (i, e) in engines.iter().enumerate() {
            let _ = writeln!(out, "{name}{{{}}} {}", lbl(i), fmt_f(get(e)));
        }
    };
    let gauge = |out: &mut String, name: &str, help: &str, get: &dyn Fn(&EngineMetrics) -> f64| floats(out, "gauge", name, help, get);
    gauge(&mut out, "vllm:num_requests_running", "Number of requests in model execution batches.", &|e| e.running.get());
    gauge(&mut out, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", &|e| e.waiting.get());
    gauge(&mut out, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", &|e| e.kv_usage.get());

    let _ = writeln!(out, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge");
    for i in 0..engines.len() {
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"{}\",engine=\"{i}\",gpu_memory_utilization=\"0.9\",kv_cache_size_tokens=\"{}\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",num_gpu_blocks_override=\"{}\",prefix_caching_hash_algo=\"sha256_cbor\"}} 1.0",
            cache.block_size,
            if cache.enable_prefix_caching { "True" } else { "False" },
            cache.block_size * cache.num_gpu_blocks,
            cache.num_gpu_blocks,
            cache.num_gpu_blocks
        );
    }

    let counter = |out: &mut String, name: &str, help: &str, get: &dyn Fn(&EngineMetrics) -> u64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for (i, e) in engines.iter().enumerate() {
            let _ = writeln!(out, "{name}{{{}}} {}.0", lbl(i), get(e));
        }
    };
    counter(&mut out, "vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", &|e| e.prefix_queries.get());
    counter(&mut out, "vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", &|e| e.prefix_hits.get());
    counter(&mut out, "vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", &|e| e.preemptions.get());
    counter(&mut out, "vllm:prompt_tokens_total", "Number of prefill tokens processed.", &|e| e.prompt_tokens.get());
    counter(&mut out, "vllm:generation_tokens_total", "Number of generation tokens processed.", &|e| e.generation_tokens.get());
    let _ = writeln!(out, "# HELP vllm:prompt_tokens_by_source Number of prompt tokens by source.\n# TYPE vllm:prompt_tokens_by_source counter");
    for (i, e) in engines.iter().enumerate() {
        for (source, v) in
            [("local_compute", &e.prompt_local_compute), ("local_cache_hit", &e.prompt_local_cache_hit), ("external_kv_transfer", &e.prompt_external)]
        {
            let _ = writeln!(out, "vllm:prompt_tokens_by_source_total{{engine=\"{i}\",model_name=\"{model}\",source=\"{source}\"}} {}.0", v.get());
        }
    }

    let _ = writeln!(out, "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter");
    for (i, e) in engines.iter().enumerate() {
        for (reason, v) in [("stop", e.success_stop.get()), ("length", e.success_length.get()), ("abort", 0), ("error", e.success_error.get())] {
            let _ = writeln!(out, "vllm:request_success_total{{engine=\"{i}\",finished_reason=\"{reason}\",model_name=\"{model}\"}} {v}.0");
        }
    }
    let _ = writeln!(out, "# HELP vllm:admission_rejections_total Requests rejected by admission control.\n# TYPE vllm:admission_rejections_total counter");
    for (i, e) in engines.iter().enumerate() {
        let _ = writeln!(
            out,
            "vllm:admission_rejections_total{{engine=\"{i}\",model_name=\"{model}\",reason=\"max_num_queued_reqs\"}} {}.0",
            e.admission_rejections.get()
        );
    }

    let hist = |out: &mut String, name: &str, help: &str, get: &dyn Fn(&EngineMetrics) -> &Histogram| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, e) in engines.iter().enumerate() {
            let h = get(e);
            let mut cum = 0;
            for (b, c) in h.bounds.iter().zip(&h.counts) {
                cum += c.load(Ordering::Relaxed);
                let _ = writeln!(out, "{name}_bucket{{engine=\"{i}\",le=\"{}\",model_name=\"{model}\"}} {cum}.0", fmt_f(*b));
            }
            let n = h.count();
            let _ = writeln!(out, "{name}_bucket{{engine=\"{i}\",le=\"+Inf\",model_name=\"{model}\"}} {n}.0");
            let _ = writeln!(out, "{name}_count{{{}}} {n}.0", lbl(i));
            let _ = writeln!(out, "{name}_sum{{{}}} {}", lbl(i), fmt_f(f64::from_bits(h.sum_bits.load(Ordering::Relaxed))));
        }
    };
    hist(&mut out, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", &|e| &e.ttft);
    hist(&mut out, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", &|e| &e.itl);
    hist(&mut out, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", &|e| &e.e2e);
    hist(&mut out, "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", &|e| &e.queue_time);

    counter(&mut out, "vllm_sim:aborted_requests_total", "Requests aborted because the client disconnected.", &|e| e.aborted.get());
    counter(&mut out, "vllm_sim:engine_steps_total", "Engine steps executed.", &|e| e.steps.get());
    floats(&mut out, "counter", "vllm_sim:engine_lag_seconds_total", "Wall time the engine fell behind its simulated clock and did not catch up.", &|e| {
        e.lag_us.get() as f64 / 1e6
    });
    gauge(&mut out, "vllm_sim:kv_held_requests", "Finished prefill requests whose KV blocks are held for a decode worker.", &|e| e.held_requests.get());
    counter(&mut out, "vllm_sim:kv_events_batches_total", "KV event batches handed to the publisher.", &|e| e.event_batches.get());
    counter(&mut out, "vllm_sim:kv_events_dropped_total", "KV event batches dropped because the publisher queue was full.", &|e| e.event_batches_dropped.get());
    out
}

fn fmt_f(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 { format!("{v:.1}") } else { format!("{v}") }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_with_labels() {
        let m = EngineMetrics::default();
        m.running.set(3.0);
        m.prefix_hits.add(32);
        m.ttft.observe(0.03);
        let text = render("m\"x", &[&m], &CacheInfo { block_size: 16, num_gpu_blocks: 100, enable_prefix_caching: true });
        assert!(text.contains("vllm:num_requests_running{engine=\"0\",model_name=\"m\\\"x\"} 3.0"), "{text}");
        assert!(text.contains("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\\\"x\"} 32.0"));
        assert!(text.contains("num_gpu_blocks=\"100\""));
        m.lag_us.add(1_500_000);
        let lagged = render("m", &[&m], &CacheInfo { block_size: 16, num_gpu_blocks: 100, enable_prefix_caching: true });
        assert!(
            lagged.contains("# TYPE vllm_sim:engine_lag_seconds_total counter\nvllm_sim:engine_lag_seconds_total{engine=\"0\",model_name=\"m\"} 1.5\n"),
            "{lagged}"
        );
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.04\",model_name=\"m\\\"x\"} 1.0"));
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.02\",model_name=\"m\\\"x\"} 0.0"));
        assert!(text.contains("vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\\\"x\"} 1.0"));
    }

    fn first(prompt: usize, cached: usize, external: usize) -> crate::scheduler::TokenOutput {
        crate::scheduler::TokenOutput {
            id: 1,
            token: 5,
            finish: None,
            first: true,
            num_cached_tokens: cached,
            num_prompt_tokens: prompt,
            num_external_tokens: external,
        }
    }

    #[test]
    fn prompt_tokens_by_source_follow_vllms_accounting() {
        let by_source = |outs: &[crate::scheduler::TokenOutput]| {
            let m = EngineMetrics::default();
            outs.iter().for_each(|o| m.count_prompt(o));
            (m.prompt_local_compute.get(), m.prompt_local_cache_hit.get(), m.prompt_external.get(), m.prompt_tokens.get())
        };
        assert_eq!(by_source(&[first(40, 0, 0)]), (40, 0, 0, 40), "aggregated, cold");
        assert_eq!(by_source(&[first(40, 32, 0)]), (8, 32, 0, 40), "aggregated, two blocks hit");
        assert_eq!(by_source(&[first(40, 39, 40)]), (1, 0, 40, 40), "decode leg: all pulled, the last token recomputed");
        assert_eq!(by_source(&[first(40, 39, 24)]), (1, 16, 24, 40), "decode leg with one block hit locally");
        let m = EngineMetrics::default();
        m.count_prompt(&first(40, 39, 40));
        let text = render("m", &[&m], &CacheInfo { block_size: 16, num_gpu_blocks: 100, enable_prefix_caching: true });
        assert!(text.contains("# TYPE vllm:prompt_tokens_by_source counter"), "{text}");
        assert!(text.contains("vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"m\",source=\"external_kv_transfer\"} 40.0"), "{text}");
        assert!(text.contains("vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"m\",source=\"local_compute\"} 1.0"));
        assert!(text.contains("vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"m\",source=\"local_cache_hit\"} 0.0"));
    }
}
