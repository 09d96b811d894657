//! Turning samples into a report: counts, latency quantiles (time to first token, time per
//! output token, end to end), throughput, goodput under an SLO and the workers' prefix-cache
//! hit rate; and writing reports as JSON, a markdown table and CDF plots of TTFT, TPOT and
//! end to end (SVG, one line per target).

use super::client::Sample;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

/// A latency SLO: a request is "good" when it succeeded within both bounds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Slo {
    /// Time to first token bound, ms.
    pub ttft_ms: f64,
    /// Mean inter-token latency bound, ms.
    pub itl_ms: f64,
}

/// p50/p90/p99 and mean, in ms.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Quantiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
}

impl Quantiles {
    /// Of `v` (ms); zeros when empty.
    pub fn of(v: &mut [f64]) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        #[allow(clippy::cast_sign_loss, reason = "a rank times a quantile in 0..=1: not negative")]
        let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
        Self { p50: at(0.5), p90: at(0.9), p99: at(0.99), mean: v.iter().sum::<f64>() / v.len() as f64 }
    }
}

/// One run against one target.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Target name.
    pub label: String,
    /// Requests sent.
    pub requests: usize,
    /// Answered in full.
    pub ok: usize,
    /// Refused with 503 (shed) or 429.
    pub shed: usize,
    /// Everything else that failed.
    pub errors: usize,
    /// First send to last answer, s.
    pub duration_s: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// Requests meeting the SLO per second.
    pub goodput_per_s: f64,
    /// Fraction of sent requests meeting the SLO.
    pub goodput_fraction: f64,
    /// The SLO.
    pub slo: Slo,
    /// Time to first token, ms (successful requests).
    pub ttft_ms: Quantiles,
    /// Inter-token latency, ms (every gap of every successful request).
    pub itl_ms: Quantiles,
    /// Time per output token, ms: each successful request's mean gap between tokens (one per
    /// request, so a long request counts as much as a short one).
    pub tpot_ms: Quantiles,
    /// End to end, ms (successful requests).
    pub e2e_ms: Quantiles,
    /// Workers' prefix-cache hits / queries during the run, if their metrics were given.
    pub hit_rate: Option<f64>,
    /// Wall time the workers' simulated engines fell behind their clocks during the run,
    /// summed over the workers, s (`vllm_sim:engine_lag_seconds_total`; 0 on real vLLM, `None`
    /// without worker metrics). Lag means the host, not the router, stretched the workers' steps:
    /// a run with much of it is not a fair draw.
    pub sim_lag_s: Option<f64>,
    /// A few error messages, for the reader.
    pub error_examples: Vec<String>,
    /// TTFT of every successful request, ms, for the plot.
    #[serde(skip)]
    pub ttft_samples: Vec<f64>,
    /// TPOT of every successful request with two tokens or more, ms, for the plot.
    #[serde(skip)]
    pub tpot_samples: Vec<f64>,
    /// End to end of every successful request, ms, for the plot.
    #[serde(skip)]
    pub e2e_samples: Vec<f64>,
    /// Every request in the order it was due, for `requests-<label>.csv`.
    #[serde(skip)]
    pub rows: Vec<Row>,
}

/// One request as `requests-<label>.csv` records it.
#[derive(Debug, Clone)]
pub struct Row {
    /// When it was due, ms from the start of the run.
    pub due_ms: f64,
    /// HTTP status (0: no response).
    pub status: u16,
    /// Prompt tokens, as the server's usage counted them (0: not reported).
    pub prompt_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Time to the first token, ms (NaN: none came).
    pub ttft_ms: f64,
    /// Mean gap between token events, ms (NaN: fewer than two events).
    pub itl_mean_ms: f64,
    /// End to end, ms.
    pub e2e_ms: f64,
}

impl Row {
    fn of(s: &Sample) -> Self {
        let itl_mean_ms = mean_itl_ms(s).unwrap_or(f64::NAN);
        Self {
            due_ms: ms(s.due),
            status: s.status,
            prompt_tokens: s.prompt_tokens,
            output_tokens: s.output_tokens,
            ttft_ms: s.ttft.map_or(f64::NAN, ms),
            itl_mean_ms,
            e2e_ms: ms(s.e2e),
        }
    }
}

/// `rows` as CSV with a header line.
pub fn rows_csv(rows: &[Row]) -> String {
    let mut out = String::from("due_ms,status,prompt_tokens,output_tokens,ttft_ms,itl_mean_ms,e2e_ms\n");
    for r in rows {
        let _ = writeln!(out, "{:.3},{},{},{},{:.3},{:.3},{:.3}", r.due_ms, r.status, r.prompt_tokens, r.output_tokens, r.ttft_ms, r.itl_mean_ms, r.e2e_ms);
    }
    out
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The mean gap between `s`'s token events, ms (`None`: fewer than two events).
fn mean_itl_ms(s: &Sample) -> Option<f64> {
    (!s.itl.is_empty()).then(|| s.itl.iter().map(|d| ms(*d)).sum::<f64>() / s.itl.len() as f64)
}

/// Summarizes `samples` taken over `duration`.
pub fn summarize(label: &str, samples: &[Sample], duration: Duration, slo: Slo, hit_rate: Option<f64>) -> Report {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok()).collect();
    let shed = samples.iter().filter(|s| !s.ok() && matches!(s.status, 503 | 429)).count();
    let errors = samples.len() - ok.len() - shed;
    let good = ok
        .iter()
        .filter(|s| {
            let ttft = s.ttft.map_or(f64::INFINITY, ms);
            let itl = mean_itl_ms(s).unwrap_or(0.0);
            ttft <= slo.ttft_ms && itl <= slo.itl_ms
        })
        .count();
    let secs = duration.as_secs_f64().max(1e-9);
    let mut ttft: Vec<f64> = ok.iter().filter_map(|s| s.ttft.map(ms)).collect();
    let mut itl: Vec<f64> = ok.iter().flat_map(|s| s.itl.iter().map(|d| ms(*d))).collect();
    let mut e2e: Vec<f64> = ok.iter().map(|s| ms(s.e2e)).collect();
    let mut tpot: Vec<f64> = ok.iter().filter_map(|s| mean_itl_ms(s)).collect();
    let mut examples: Vec<String> = samples.iter().filter_map(|s| s.error.clone()).collect();
    examples.sort();
    examples.dedup();
    examples.truncate(5);
    let ttft_q = Quantiles::of(&mut ttft);
    Report {
        label: label.to_string(),
        requests: samples.len(),
        ok: ok.len(),
        shed,
        errors,
        duration_s: secs,
        requests_per_s: ok.len() as f64 / secs,
        output_tokens_per_s: ok.iter().map(|s| s.output_tokens).sum::<u64>() as f64 / secs,
        goodput_per_s: good as f64 / secs,
        goodput_fraction: if samples.is_empty() { 0.0 } else { good as f64 / samples.len() as f64 },
        slo,
        ttft_ms: ttft_q,
        itl_ms: Quantiles::of(&mut itl),
        tpot_ms: Quantiles::of(&mut tpot),
        e2e_ms: Quantiles::of(&mut e2e),
        hit_rate,
        sim_lag_s: None,
        error_examples: examples,
        ttft_samples: ttft,
        tpot_samples: tpot,
        e2e_samples: e2e,
        rows: {
            let mut rows: Vec<Row> = samples.iter().map(Row::of).collect();
            rows.sort_by(|a, b| a.due_ms.total_cmp(&b.due_ms));
            rows
        },
    }
}

/// The side-by-side markdown table.
pub fn markdown(reports: &[Report]) -> String {
    let mut t = String::from(
        "| target | requests | ok | shed | errors | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | TPOT p90 | TPOT p99 | E2E p50 | E2E p90 | E2E p99 | ITL p99 | req/s | out tok/s | goodput | hit rate | sim lag |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in reports {
        let hit = r.hit_rate.map_or("n/a".to_string(), |h| format!("{h:.3}"));
        let lag = r.sim_lag_s.map_or("n/a".to_string(), |l| format!("{l:.2} s"));
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {:.0} ms | {:.0} ms | {:.0} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.2} s | {:.2} s | {:.2} s | {:.1} ms | {:.2} | {:.0} | {:.0}% | {hit} | {lag} |",
            r.label,
            r.requests,
            r.ok,
            r.shed,
            r.errors,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.tpot_ms.p50,
            r.tpot_ms.p90,
            r.tpot_ms.p99,
            r.e2e_ms.p50 / 1000.0,
            r.e2e_ms.p90 / 1000.0,
            r.e2e_ms.p99 / 1000.0,
            r.itl_ms.p99,
            r.requests_per_s,
            r.output_tokens_per_s,
            r.goodput_fraction * 100.0,
        );
    }
    t
}

/// TTFT CDFs, one polyline per report, log-scaled time axis.
pub fn ttft_cdf_svg(reports: &[Report]) -> String {
    cdf_svg(reports, |r| &r.ttft_samples, "time to first token")
}

/// CDFs of what `samples` picks of each report (ms), one polyline per report, log-scaled time
/// axis labelled `axis`.
pub fn cdf_svg(reports: &[Report], samples: impl Fn(&Report) -> &[f64], axis: &str) -> String {
    const W: f64 = 720.0;
    const H: f64 = 420.0;
    const L: f64 = 60.0;
    const R: f64 = 20.0;
    const T: f64 = 20.0;
    const B: f64 = 50.0;
    const COLORS: &[&str] = &["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666"];
    let all: Vec<f64> = reports.iter().flat_map(|r| samples(r).iter().copied()).filter(|v| *v > 0.0).collect();
    if all.is_empty() {
        return format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\"><text x=\"20\" y=\"40\">no successful request: no {} to plot</text></svg>\n",
            xml(axis)
        );
    }
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min).max(0.1).log10().floor();
    let hi = all.iter().copied().fold(1.0, f64::max).log10().ceil().max(lo + 1.0);
    let x = |ms: f64| L + (ms.max(0.1).log10() - lo) / (hi - lo) * (W - L - R);
    let y = |f: f64| H - B - f * (H - T - B);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for e in (lo as i32)..=(hi as i32) {
        let px = x(10f64.powi(e));
        let _ = writeln!(
            s,
            "<line x1=\"{px:.1}\" y1=\"{T}\" x2=\"{px:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/><text x=\"{px:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            H - B,
            H - B + 16.0,
            fmt_ms(10f64.powi(e))
        );
    }
    for q in [0.0, 0.5, 0.9, 1.0] {
        let py = y(q);
        let _ = writeln!(
            s,
            "<line x1=\"{L}\" y1=\"{py:.1}\" x2=\"{:.1}\" y2=\"{py:.1}\" stroke=\"#ddd\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{q}</text>",
            W - R,
            L - 6.0,
            py + 4.0
        );
    }
    let _ = writeln!(s, "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{} (log scale)</text>", (L + W - R) / 2.0, H - 12.0, xml(axis));
    for (i, r) in reports.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut v = samples(r).to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1) as f64;
        let points: Vec<String> = v.iter().enumerate().map(|(k, ms)| format!("{:.1},{:.1}", x(*ms), y((k + 1) as f64 / n))).collect();
        let _ = writeln!(s, "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>", points.join(" "));
        let ly = T + 16.0 * (i as f64 + 1.0);
        let _ = writeln!(
            s,
            "<line x1=\"{:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{color}\" stroke-width=\"3\"/><text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            L + 10.0,
            L + 30.0,
            L + 36.0,
            ly + 4.0,
            xml(&r.label)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn fmt_ms(ms: f64) -> String {
    if ms >= 1000.0 { format!("{}s", ms / 1000.0) } else { format!("{ms}ms") }
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Writes `results.json`, `results.md`, `ttft_cdf.svg` and one `requests-<label>.csv` per
/// target into `dir`.
pub fn write(dir: &Path, reports: &[Report], note: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut names = std::collections::HashSet::new();
    for r in reports {
        // A label's characters other than letters, digits, `-` and `_` become `_`; a label that
        // then names a file already written is numbered.
        let base: String = r.label.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
        // Of `names.len() + 1` candidates at least one is free.
        let name = (1..=names.len() + 1).map(|n| if n == 1 { base.clone() } else { format!("{base}-{n}") }).find(|n| names.insert(n.clone())).unwrap_or(base);
        std::fs::write(dir.join(format!("requests-{name}.csv")), rows_csv(&r.rows))?;
    }
    std::fs::write(dir.join("results.json"), serde_json::to_string_pretty(reports).map_err(std::io::Error::other)?)?;
    std::fs::write(dir.join("results.md"), format!("{note}\n\n{}", markdown(reports)))?;
    std::fs::write(dir.join("ttft_cdf.svg"), ttft_cdf_svg(reports))?;
    std::fs::write(dir.join("tpot_cdf.svg"), cdf_svg(reports, |r| &r.tpot_samples, "time per output token"))?;
    std::fs::write(dir.join("e2e_cdf.svg"), cdf_svg(reports, |r| &r.e2e_samples, "end to end"))?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::float_cmp, reason = "tests compare exact values, computed by the same arithmetic as their expectations")]
mod tests {
    use super::*;

    fn sample(status: u16, ttft_ms: Option<u64>, itl_ms: &[u64]) -> Sample {
        Sample {
            status,
            ttft: ttft_ms.map(Duration::from_millis),
            itl: itl_ms.iter().map(|&m| Duration::from_millis(m)).collect(),
            e2e: Duration::from_millis(ttft_ms.unwrap_or(0) + itl_ms.iter().sum::<u64>()),
            output_tokens: 1 + itl_ms.len() as u64,
            error: (status != 200).then(|| format!("HTTP {status}")),
            ..Default::default()
        }
    }

    #[test]
    fn counts_add_up_and_goodput_follows_the_slo() {
        let mut s = vec![
            sample(200, Some(100), &[10, 10]),
            sample(200, Some(3000), &[10]),
            sample(503, None, &[]),
            sample(500, None, &[]),
            sample(200, Some(50), &[200]),
        ];
        // Rows come out in the order the requests were due, whatever order they finished in.
        for (i, x) in s.iter_mut().enumerate() {
            x.due = Duration::from_millis(10 * (5 - i as u64));
        }
        let r = summarize("t", &s, Duration::from_secs(2), Slo { ttft_ms: 1000.0, itl_ms: 50.0 }, Some(0.5));
        assert_eq!((r.requests, r.ok, r.shed, r.errors), (5, 3, 1, 1));
        assert!((r.goodput_fraction - 0.2).abs() < 1e-9, "only the first meets both bounds");
        assert_eq!(r.ttft_ms.p50, 100.0);
        assert!(r.ttft_ms.p50 <= r.ttft_ms.p90 && r.ttft_ms.p90 <= r.ttft_ms.p99);
        assert_eq!(r.output_tokens_per_s, 7.0 / 2.0);
        let md = markdown(std::slice::from_ref(&r));
        assert!(md.contains("| t | 5 | 3 | 1 | 1 |"), "{md}");
        assert!(md.trim_end().ends_with("| 0.500 | n/a |"), "no worker lag read: {md}");
        let lagged = markdown(&[Report { sim_lag_s: Some(1.234), ..r.clone() }]);
        assert!(lagged.trim_end().ends_with("| 0.500 | 1.23 s |"), "{lagged}");
        let csv = rows_csv(&r.rows);
        let svg = ttft_cdf_svg(&[r]);
        assert!(svg.starts_with("<svg") && svg.contains("<polyline") && !svg.contains("NaN"), "{svg}");
        assert_eq!(csv.lines().count(), 6, "a header and a row per request: {csv}");
        assert!(csv.lines().nth(1).is_some_and(|l| l.starts_with("10.000,200,0,2,50.000,200.000,250.000")), "{csv}");
        assert!(csv.lines().nth(5).is_some_and(|l| l.starts_with("50.000,200,0,3,100.000,10.000,120.000")), "{csv}");
        assert!(csv.contains(",503,0,1,NaN,NaN,"), "a request without a token has no TTFT: {csv}");
        let none = summarize("empty", &[sample(503, None, &[])], Duration::from_secs(1), Slo { ttft_ms: 1.0, itl_ms: 1.0 }, None);
        assert!(ttft_cdf_svg(&[none]).contains("no successful request"));
    }
}
