//! `ember bench idle`: how long the first token takes after the server sat idle, against back to
//! back. One greedy streaming chat request at a time, each sent a gap after the previous one
//! finished, each prompt with a fresh nonce so no prompt cache can help. Works against any
//! OpenAI-compatible server (llama-server, vLLM, ember).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::args::BenchIdleArgs;
use crate::http_client::{self, BaseUrl};
use crate::server_process::{self, PageOut};

/// Longest wait for a server that is still loading its model.
const LOAD_TIMEOUT: Duration = Duration::from_secs(600);

/// Longest wait for a reply: a cold first token on a slow machine takes seconds, not minutes.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

pub fn run(args: BenchIdleArgs) -> anyhow::Result<ExitCode> {
    if args.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if let Some(bad) = args.gaps.iter().find(|g| !(g.is_finite() && **g >= 0.0)) {
        bail!("--gaps: {bad} is not a number of seconds >= 0");
    }
    let base = BaseUrl::parse(&args.api)?;
    let pid = args.server_pid.or_else(|| {
        base.is_local()
            .then(|| server_process::pid_listening_on(base.port))
            .flatten()
    });
    match pid {
        Some(pid) => eprintln!("bench idle: server pid {pid}"),
        None if args.evict => bail!(
            "--evict needs the server's pid: no process here is seen listening on port {}; \
             pass --server-pid",
            base.port
        ),
        None => eprintln!(
            "bench idle: the server's process is not visible here; major faults are not counted \
             (pass --server-pid for a local server)"
        ),
    }
    http_client::wait_ready(&base, args.api_key.as_deref(), LOAD_TIMEOUT)?;
    let model = match &args.model {
        Some(model) => model.clone(),
        None => first_model(&base, args.api_key.as_deref())?,
    };
    let mut client = Client {
        base,
        api_key: args.api_key.clone(),
        model,
        max_tokens: args.max_tokens,
        nonce: nonce_seed(),
    };

    // One request first, so the baseline does not pay for whatever the server does first.
    let warmup = client.first_token()?;
    eprintln!("bench idle: warm-up request, first token after {warmup:.3} s");

    let mut baseline = None;
    let series = std::iter::once((0.0, false)).chain(args.gaps.iter().map(|&g| (g, args.evict)));
    for (gap_s, evict) in series {
        // After each request that follows a gap (or a reclaim), one more right after it: a
        // back-to-back control taken in the same minutes, so a change in the machine's load
        // between the baseline series and this one does not read as a cost of the gap.
        let controls = gap_s > 0.0 || evict;
        let mut first_token_s = Vec::with_capacity(args.repeats);
        let mut control_s = Vec::with_capacity(args.repeats);
        let mut other_cpu_s = Vec::with_capacity(args.repeats);
        let mut faults: Option<server_process::Faults> = pid.map(|_| Default::default());
        let mut paged_out = PageOut::default();
        for _ in 0..args.repeats {
            let gap_start = Instant::now();
            if evict && let Some(pid) = pid {
                let report = server_process::page_out(pid).with_context(|| {
                    format!(
                        "paging out the server's memory (process_madvise on pid {pid}: needs \
                         Linux 5.10+ and the right to trace the server)"
                    )
                })?;
                paged_out.mappings = report.mappings;
                paged_out.refused = report.refused;
                paged_out.bytes = report.bytes;
            }
            let gap = Duration::from_secs_f64(gap_s);
            if let Some(left) = gap.checked_sub(gap_start.elapsed()) {
                std::thread::sleep(left);
            }
            let before = pid.map(server_process::faults).transpose()?;
            let cpu = OtherCpu::start(pid);
            first_token_s.push(client.first_token()?);
            other_cpu_s.push(cpu.and_then(OtherCpu::seconds));
            if let (Some(total), Some(before), Some(pid)) = (faults.as_mut(), before, pid) {
                let during = server_process::faults(pid)?.since(before);
                total.major += during.major;
                total.minor += during.minor;
            }
            if controls {
                control_s.push(client.first_token()?);
            }
        }
        let gap_median = median(&first_token_s);
        let base_median = *baseline.get_or_insert(gap_median);
        let mut line = json!({
            "gap_s": gap_s,
            "evict": evict,
            "first_token_s": first_token_s.iter().map(|t| round(*t)).collect::<Vec<_>>(),
            "median_s": round(gap_median),
            "max_s": round(first_token_s.iter().copied().fold(0.0, f64::max)),
            "vs_back_to_back": ratio(gap_median, base_median),
            "server_major_faults": faults.map(|f| f.major),
            // Pages the requests touched that were not mapped: memory outside a held set that
            // the OS (or --evict) took back without a disk read.
            "server_minor_faults": faults.map(|f| f.minor),
            // CPU seconds the rest of the machine used during each timed request (other
            // processes, and time the hypervisor took): on a shared machine, a high figure
            // marks a sample slowed by someone else, not by the gap.
            "other_cpu_s": other_cpu_s
                .iter()
                .map(|s| s.map(|s| (s * 100.0).round() / 100.0))
                .collect::<Vec<_>>(),
        });
        if controls {
            let control_median = median(&control_s);
            line["control_first_token_s"] =
                json!(control_s.iter().map(|t| round(*t)).collect::<Vec<_>>());
            line["control_median_s"] = json!(round(control_median));
            line["vs_control"] = json!(ratio(gap_median, control_median));
        }
        if evict {
            line["paged_out_mappings"] = json!(paged_out.mappings);
            // Locked mappings (a held set) and special ones ([vvar]) are refused by the kernel.
            line["mappings_refused"] = json!(paged_out.refused);
        }
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

struct Client {
    base: BaseUrl,
    api_key: Option<String>,
    model: String,
    max_tokens: usize,
    nonce: u64,
}

impl Client {
    /// Sends one greedy streaming chat request with a fresh nonce, reads it to the end, and
    /// returns the seconds from sending to the first generated text.
    fn first_token(&mut self) -> anyhow::Result<f64> {
        self.nonce = self
            .nonce
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let body = json!({
            "model": self.model,
            "messages": [{
                "role": "user",
                "content": format!("Request {:016x}. In one sentence, what is a river?", self.nonce),
            }],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": true,
        });
        let start = Instant::now();
        let mut response = http_client::post_stream(
            &self.base,
            "/v1/chat/completions",
            self.api_key.as_deref(),
            &body,
            REQUEST_TIMEOUT,
        )?;
        let mut first = None;
        // Read to the end: the next request must not overlap this one's tail.
        while let Some(event) = response.next_event()? {
            if first.is_none() && has_text(&event) {
                first = Some(start.elapsed().as_secs_f64());
            }
        }
        first.context("the stream ended without any generated text")
    }
}

/// Whether a chat chunk carries generated text (answer or reasoning); role-only chunks do not.
fn has_text(event: &Value) -> bool {
    let delta = &event["choices"][0]["delta"];
    ["content", "reasoning_content"]
        .iter()
        .any(|k| delta[k].as_str().is_some_and(|s| !s.is_empty()))
}

pub(crate) fn first_model(base: &BaseUrl, api_key: Option<&str>) -> anyhow::Result<String> {
    let response = http_client::request(
        base,
        "GET",
        "/v1/models",
        api_key,
        None,
        Duration::from_secs(30),
    )
    .with_context(|| format!("asking {}:{} for its models", base.host, base.port))?;
    let status = response.status;
    let text = response.text()?;
    if status != 200 {
        bail!("/v1/models answered {status}: {}", text.trim());
    }
    let models: Value = serde_json::from_str(&text).context("/v1/models is not JSON")?;
    models["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .context("/v1/models lists no model; pass --model")
}

/// A different starting nonce per run, so two runs never send the same prompts.
fn nonce_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ (u64::from(std::process::id()) << 32)
}

/// CPU time the rest of the machine uses while a request runs: all busy CPU time (steal
/// included) less the server's and this process's own.
struct OtherCpu {
    server: Option<u32>,
    machine: f64,
    server_cpu: f64,
    own: f64,
}

impl OtherCpu {
    /// `None` where /proc is not readable.
    fn start(server: Option<u32>) -> Option<OtherCpu> {
        Some(OtherCpu {
            server,
            machine: server_process::machine_busy_seconds().ok()?,
            server_cpu: match server {
                Some(pid) => server_process::cpu_seconds(pid).ok()?,
                None => 0.0,
            },
            own: server_process::cpu_seconds(std::process::id()).ok()?,
        })
    }

    fn seconds(self) -> Option<f64> {
        let machine = server_process::machine_busy_seconds().ok()? - self.machine;
        let server = match self.server {
            Some(pid) => server_process::cpu_seconds(pid).ok()? - self.server_cpu,
            None => 0.0,
        };
        let own = server_process::cpu_seconds(std::process::id()).ok()? - self.own;
        // The three are read at slightly different moments, in whole ticks.
        Some((machine - server - own).max(0.0))
    }
}

fn ratio(value: f64, base: f64) -> f64 {
    (value / base * 1000.0).round() / 1000.0
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    }
}

fn round(seconds: f64) -> f64 {
    (seconds * 1e4).round() / 1e4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn text_chunks_are_told_from_role_chunks() {
        let role = json!({"choices": [{"delta": {"role": "assistant", "content": ""}}]});
        let text = json!({"choices": [{"delta": {"content": "Hi"}}]});
        let thinking = json!({"choices": [{"delta": {"reasoning_content": "Hmm"}}]});
        assert!(!has_text(&role));
        assert!(has_text(&text));
        assert!(has_text(&thinking));
    }
}
