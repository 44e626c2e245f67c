//! Prometheus counters, gauges and histograms for `/metrics`, in the text exposition format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use ember_engine::prompt_cache::PromptCacheSnapshot;
use ember_residency::Stats;

/// Latency buckets in seconds, from a fast token to a slow first token.
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Tokens a forward pass of the batched loop computed: a decode step of one sequence up to a
/// full prompt chunk.
const BATCH_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
];

pub struct Histogram {
    buckets: &'static [f64],
    counts: Vec<AtomicU64>,
    count: AtomicU64,
    /// Sum in millionths (microseconds for latencies), so it can be an atomic integer.
    sum_micros: AtomicU64,
}

impl Histogram {
    fn new(buckets: &'static [f64]) -> Self {
        Histogram {
            buckets,
            counts: buckets.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, seconds: f64) {
        for (bound, count) in self.buckets.iter().zip(&self.counts) {
            if seconds <= *bound {
                count.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((seconds * 1e6) as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, count) in self.buckets.iter().zip(&self.counts) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{bound}\"}} {}",
                count.load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {count}");
    }
}

pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Speculative decoding: tokens drafted and verified, and those accepted.
    pub draft_tokens: AtomicU64,
    pub draft_accepted_tokens: AtomicU64,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub running: AtomicI64,
    pub queued: AtomicI64,
    /// The batched loop's sequences holding KV blocks and waiting for them, as of its last
    /// step; its preemptions; the tokens of each of its forward passes.
    pub sequences_running: AtomicI64,
    pub sequences_waiting: AtomicI64,
    pub preemptions: AtomicU64,
    pub batch_tokens: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            draft_tokens: AtomicU64::new(0),
            draft_accepted_tokens: AtomicU64::new(0),
            time_to_first_token: Histogram::new(LATENCY_BUCKETS),
            inter_token_latency: Histogram::new(LATENCY_BUCKETS),
            running: AtomicI64::new(0),
            queued: AtomicI64::new(0),
            sequences_running: AtomicI64::new(0),
            sequences_waiting: AtomicI64::new(0),
            preemptions: AtomicU64::new(0),
            batch_tokens: Histogram::new(BATCH_BUCKETS),
        }
    }
}

impl Metrics {
    /// Counts a finished request by endpoint (a route template, never the raw path) and status.
    pub fn count_request(&self, endpoint: &'static str, status: u16) {
        *self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((endpoint, status))
            .or_default() += 1;
    }

    /// The text for `/metrics`; `residency` and `cache` are `None` until the model is loaded
    /// (their series read 0 then, so scrapers see every name from the start).
    pub fn render(&self, residency: Option<Stats>, cache: Option<PromptCacheSnapshot>) -> String {
        let mut out = String::new();
        out.push_str("# HELP ember_requests_total Requests answered, by endpoint and HTTP status.\n# TYPE ember_requests_total counter\n");
        for ((endpoint, status), count) in self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "ember_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {count}"
            );
        }
        let counter = |out: &mut String, name: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, value: i64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        };
        counter(
            &mut out,
            "ember_prompt_tokens_total",
            "Prompt tokens processed.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "ember_generation_tokens_total",
            "Tokens generated.",
            self.generation_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "ember_draft_tokens_total",
            "Tokens drafted (speculative decoding) and verified by the model.",
            self.draft_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "ember_draft_accepted_tokens_total",
            "Drafted tokens the model accepted.",
            self.draft_accepted_tokens.load(Ordering::Relaxed),
        );
        self.time_to_first_token.render(
            &mut out,
            "ember_time_to_first_token_seconds",
            "From request arrival to the first generated token.",
        );
        self.inter_token_latency.render(
            &mut out,
            "ember_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request.",
        );
        gauge(
            &mut out,
            "ember_requests_running",
            "Requests generating now.",
            self.running.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "ember_requests_queued",
            "Requests waiting for the engine.",
            self.queued.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "ember_sequences_running",
            "Sequences of the batched loop holding KV blocks, as of its last step.",
            self.sequences_running.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "ember_sequences_waiting",
            "Sequences of the batched loop waiting for KV blocks or a place, as of its last step.",
            self.sequences_waiting.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "ember_preemptions_total",
            "Running sequences preempted to free KV blocks (each recomputes its tokens later).",
            self.preemptions.load(Ordering::Relaxed),
        );
        self.batch_tokens.render(
            &mut out,
            "ember_batch_tokens",
            "Tokens (decode rows and prompt chunks) each forward pass of the batched loop computed.",
        );
        render_residency(&mut out, residency);
        render_prompt_cache(&mut out, cache.unwrap_or_default());
        out
    }
}

fn render_prompt_cache(out: &mut String, c: PromptCacheSnapshot) {
    let series: [(&str, &str, &str, u64); 10] = [
        (
            "ember_prompt_cache_bytes",
            "gauge",
            "Bytes of KV blocks the prompt cache holds (device memory on a GPU).",
            c.bytes,
        ),
        (
            "ember_prompt_cache_blocks",
            "gauge",
            "KV blocks the prompt cache holds.",
            c.blocks,
        ),
        (
            "ember_prompt_cache_budget_bytes",
            "gauge",
            "The prompt cache's budget in the KV pool (--prompt-cache-gib).",
            c.budget_bytes,
        ),
        (
            "ember_prompt_cache_hits_total",
            "counter",
            "Requests that reused a cached prefix.",
            c.hits_total,
        ),
        (
            "ember_prompt_cache_misses_total",
            "counter",
            "Requests that found no cached prefix.",
            c.misses_total,
        ),
        (
            "ember_prompt_cache_hit_tokens_total",
            "counter",
            "Prompt tokens served from the cache instead of prefilled.",
            c.hit_tokens_total,
        ),
        (
            "ember_prompt_cache_evictions_total",
            "counter",
            "Cached blocks that left the pool (to the host tier, or dropped).",
            c.evictions_total,
        ),
        (
            "ember_prompt_cache_host_bytes",
            "gauge",
            "Bytes of cached blocks in the host tier (--prompt-cache-host-gib).",
            c.host_bytes,
        ),
        (
            "ember_prompt_cache_host_blocks",
            "gauge",
            "Cached blocks in the host tier.",
            c.host_blocks,
        ),
        (
            "ember_prompt_cache_host_evictions_total",
            "counter",
            "Blocks dropped from the host tier.",
            c.host_evictions_total,
        ),
    ];
    for (name, kind, help, value) in series {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    }
}

fn render_residency(out: &mut String, stats: Option<Stats>) {
    let held = |f: fn(&Stats) -> u64| stats.as_ref().map_or(0, f);
    let series: [(&str, &str, &str, u64); 6] = [
        (
            "ember_residency_bytes",
            "gauge",
            "Bytes the residency set holds resident (host and device).",
            held(|s| s.bytes),
        ),
        (
            "ember_residency_buffers",
            "gauge",
            "Buffers the residency set holds.",
            held(|s| s.buffers as u64),
        ),
        (
            "ember_residency_staged",
            "gauge",
            "Buffers waiting to join the set at the next commit.",
            held(|s| s.staged as u64),
        ),
        (
            "ember_residency_commits_total",
            "counter",
            "Commits that changed the held set (load, staged joins, leaves).",
            held(|s| s.commits),
        ),
        (
            "ember_residency_refusals_total",
            "counter",
            "Holds refused: at load, joins over the bound, failed commits.",
            held(|s| s.refusals),
        ),
        (
            "ember_keepalive_ticks_total",
            "counter",
            "Idle keepalive ticks (commit, then a 16-byte copy in held memory).",
            held(|s| s.ticks),
        ),
    ];
    for (name, kind, help, value) in series {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    }
    let device = held(|s| s.device_bytes);
    let _ = writeln!(
        out,
        "# HELP ember_residency_device_bytes The device part of ember_residency_bytes.\n# TYPE ember_residency_device_bytes gauge\nember_residency_device_bytes {device}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.count_request("/v1/completions", 200);
        m.count_request("/v1/completions", 200);
        m.time_to_first_token.observe(0.02);
        let text = m.render(None, None);
        assert!(
            text.contains("ember_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2")
        );
        assert!(text.contains("ember_time_to_first_token_seconds_bucket{le=\"0.025\"} 1"));
        assert!(text.contains("ember_time_to_first_token_seconds_bucket{le=\"0.01\"} 0"));
        assert!(text.contains("ember_time_to_first_token_seconds_count 1"));
        assert!(text.contains("# TYPE ember_requests_queued gauge"));
        assert!(text.contains("ember_residency_bytes 0\n"));
        assert!(text.contains("# TYPE ember_keepalive_ticks_total counter"));
        assert!(text.contains("ember_prompt_cache_bytes 0\n"));
        assert!(text.contains("# TYPE ember_prompt_cache_hit_tokens_total counter"));
        let cache = PromptCacheSnapshot {
            hits_total: 3,
            hit_tokens_total: 96,
            ..Default::default()
        };
        let text = m.render(None, Some(cache));
        assert!(text.contains("ember_prompt_cache_hits_total 3\n"));
        assert!(text.contains("ember_prompt_cache_hit_tokens_total 96\n"));
    }
}
