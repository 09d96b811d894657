//! Llumnix's load-balance rescheduling policy: workers at or over the load threshold are
//! sources, workers under it destinations; metricBalanceSelector pairs the most loaded source
//! with the least loaded destination, the next with the next, until either side runs out. Each
//! pair moves `value` of work chosen by `rule` and `order`.
//!
//! Config (one `key = value` per line, `#` comments):
//! ```text
//! threshold = 0.7   # load >= threshold: source; < threshold: destination
//! rule = token      # num_req | token | ratio
//! order = sr        # lcr | fcr | lr | sr | fcw | fcwsr
//! value = 1024
//! ```

#![no_std]

extern crate alloc;

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use kvgate_policy_sdk::Local;
use kvgate_policy_sdk::rescheduling::{ClusterView, Migration, Policy, SelectOrder, SelectRule};

#[derive(Clone, Copy)]
struct Settings {
    threshold: f64,
    rule: SelectRule,
    order: SelectOrder,
    value: f64,
}

const DEFAULTS: Settings = Settings { threshold: 0.7, rule: SelectRule::Token, order: SelectOrder::Sr, value: 1024.0 };

static SETTINGS: Local<Settings> = Local::new(DEFAULTS);

fn parse(config: &str) -> Result<Settings, String> {
    let mut s = DEFAULTS;
    for (n, line) in config.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let Some((k, v)) = line.split_once('=') else { return Err(format!("line {}: expected key = value", n + 1)) };
        let (k, v) = (k.trim(), v.trim().to_ascii_lowercase());
        let bad = || format!("line {}: bad value {v:?} for {k}", n + 1);
        match k {
            "threshold" => s.threshold = v.parse().map_err(|_| bad())?,
            "value" => s.value = v.parse().map_err(|_| bad())?,
            "rule" => {
                s.rule = match v.as_str() {
                    "num_req" => SelectRule::NumReq,
                    "token" => SelectRule::Token,
                    "ratio" => SelectRule::Ratio,
                    _ => return Err(bad()),
                }
            }
            "order" => {
                s.order = match v.as_str() {
                    "lcr" => SelectOrder::Lcr,
                    "fcr" => SelectOrder::Fcr,
                    "lr" => SelectOrder::Lr,
                    "sr" => SelectOrder::Sr,
                    "fcw" => SelectOrder::Fcw,
                    "fcwsr" => SelectOrder::Fcwsr,
                    _ => return Err(bad()),
                }
            }
            _ => return Err(format!("line {}: unknown key {k:?} (threshold, rule, order, value)", n + 1)),
        }
    }
    Ok(s)
}

struct LoadBalance;

impl Policy for LoadBalance {
    fn init(config: String) -> Result<(), String> {
        let s = parse(&config)?;
        SETTINGS.with(|settings| *settings = s);
        Ok(())
    }

    fn reschedule(view: ClusterView) -> Vec<Migration> {
        let s = SETTINGS.with(|settings| *settings);
        let healthy = view.workers.iter().filter(|w| w.healthy);
        let mut sources: Vec<(f64, u32)> = healthy.clone().filter(|w| w.load >= s.threshold).map(|w| (w.load, w.id)).collect();
        let mut destinations: Vec<(f64, u32)> = healthy.filter(|w| w.load < s.threshold).map(|w| (w.load, w.id)).collect();
        sources.sort_by(|a, b| b.0.total_cmp(&a.0));
        destinations.sort_by(|a, b| a.0.total_cmp(&b.0));
        sources
            .iter()
            .zip(&destinations)
            .map(|(src, dst)| Migration { source: src.1, destination: dst.1, rule: s.rule, order: s.order, value: s.value })
            .collect()
    }
}

kvgate_policy_sdk::export_rescheduler!(LoadBalance);
