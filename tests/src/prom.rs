//! A small Prometheus text-format parser for assertions on `/metrics`.

use std::collections::BTreeMap;

/// One sample: name, labels, value.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Metric name (with `_total`, `_bucket` ... suffixes as exposed).
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Value.
    pub value: f64,
}

/// All samples of one scrape.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// Samples in exposition order.
    pub samples: Vec<Sample>,
}

impl Metrics {
    /// Parses the text exposition format (comments skipped).
    pub fn parse(text: &str) -> Self {
        let mut samples = Vec::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (head, value) = match line.rfind(' ') {
                Some(i) => (&line[..i], &line[i + 1..]),
                None => continue,
            };
            let Ok(value) = value.parse::<f64>() else { continue };
            let (name, labels) = match head.find('{') {
                Some(i) => (&head[..i], parse_labels(&head[i + 1..head.len() - 1])),
                None => (head, BTreeMap::new()),
            };
            samples.push(Sample { name: name.to_string(), labels, value });
        }
        Self { samples }
    }

    /// Sum of a metric over samples whose labels include all of `want`.
    pub fn sum(&self, name: &str, want: &[(&str, &str)]) -> f64 {
        self.samples.iter().filter(|s| s.name == name && want.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))).map(|s| s.value).sum()
    }

    /// Whether any sample has this name.
    pub fn has(&self, name: &str) -> bool {
        self.samples.iter().any(|s| s.name == name)
    }

    /// A label of the first sample of an info metric.
    pub fn info_label(&self, name: &str, label: &str) -> Option<String> {
        self.samples.iter().find(|s| s.name == name)?.labels.get(label).cloned()
    }
}

fn parse_labels(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim_start_matches(',').trim().to_string();
        let after = &rest[eq + 1..];
        let Some(body) = after.strip_prefix('"') else { break };
        let mut val = String::new();
        let mut chars = body.char_indices();
        let mut end = body.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        val.push(if n == 'n' { '\n' } else { n });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => val.push(c),
            }
        }
        out.insert(key, val);
        rest = &body[end..];
    }
    out
}
