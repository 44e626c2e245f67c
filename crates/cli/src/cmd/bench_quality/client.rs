//! The requests the checks send and the replies they compare: one shape for chat and text
//! completions, streamed or not, so every check compares like with like.

use std::time::Duration;

use serde_json::{Value, json};

use crate::http_client::{self, BaseUrl};

pub struct Client {
    pub base: BaseUrl,
    pub api_key: Option<String>,
    pub model: String,
    pub timeout: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "completions",
        }
    }
}

/// One request's body, without the model (the client adds it) or `stream`.
#[derive(Clone, Debug)]
pub struct Request {
    pub endpoint: Endpoint,
    pub body: Value,
}

impl Request {
    /// A greedy chat request.
    pub fn chat(messages: Value, max_tokens: usize) -> Request {
        Request {
            endpoint: Endpoint::Chat,
            body: json!({"messages": messages, "max_tokens": max_tokens, "temperature": 0}),
        }
    }

    /// A greedy chat request of one user message.
    pub fn ask(question: &str, max_tokens: usize) -> Request {
        Request::chat(json!([{"role": "user", "content": question}]), max_tokens)
    }

    /// A greedy text completion.
    pub fn complete(prompt: &str, max_tokens: usize) -> Request {
        Request {
            endpoint: Endpoint::Completions,
            body: json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
        }
    }

    /// The same request with `key` set to `value`.
    pub fn with(mut self, key: &str, value: Value) -> Request {
        self.body[key] = value;
        self
    }
}

/// What a reply says, streamed or not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    /// The chat message's `content`, or the completion's `text`.
    pub content: String,
    /// The chat message's `reasoning_content` (empty when absent).
    pub reasoning: String,
    pub finish_reason: Option<String>,
    /// `usage.completion_tokens`, when the server reported it.
    pub completion_tokens: Option<u64>,
}

impl Client {
    pub fn send(&self, request: &Request) -> anyhow::Result<Reply> {
        let body = self.body(request, false);
        let answer = http_client::post_json(
            &self.base,
            request.endpoint.path(),
            self.api_key.as_deref(),
            &body,
            self.timeout,
        )?;
        let choice = &answer["choices"][0];
        if !choice.is_object() {
            anyhow::bail!("the answer has no choices: {answer}");
        }
        let (content, reasoning) = match request.endpoint {
            Endpoint::Chat => (
                &choice["message"]["content"],
                &choice["message"]["reasoning_content"],
            ),
            Endpoint::Completions => (&choice["text"], &Value::Null),
        };
        Ok(Reply {
            content: content.as_str().unwrap_or_default().to_owned(),
            reasoning: reasoning.as_str().unwrap_or_default().to_owned(),
            finish_reason: choice["finish_reason"].as_str().map(str::to_owned),
            completion_tokens: answer["usage"]["completion_tokens"].as_u64(),
        })
    }

    /// The same request streamed: the text of every chunk joined.
    pub fn send_streamed(&self, request: &Request) -> anyhow::Result<Reply> {
        let body = self.body(request, true);
        let mut response = http_client::post_stream(
            &self.base,
            request.endpoint.path(),
            self.api_key.as_deref(),
            &body,
            self.timeout,
        )?;
        let mut reply = Reply::default();
        while let Some(event) = response.next_event()? {
            let choice = &event["choices"][0];
            let (content, reasoning) = match request.endpoint {
                Endpoint::Chat => (
                    &choice["delta"]["content"],
                    &choice["delta"]["reasoning_content"],
                ),
                Endpoint::Completions => (&choice["text"], &Value::Null),
            };
            reply.content += content.as_str().unwrap_or_default();
            reply.reasoning += reasoning.as_str().unwrap_or_default();
            if let Some(reason) = choice["finish_reason"].as_str() {
                reply.finish_reason = Some(reason.to_owned());
            }
            if let Some(n) = event["usage"]["completion_tokens"].as_u64() {
                reply.completion_tokens = Some(n);
            }
        }
        Ok(reply)
    }

    /// Either of the above.
    pub fn send_as(&self, request: &Request, streamed: bool) -> anyhow::Result<Reply> {
        if streamed {
            self.send_streamed(request)
        } else {
            self.send(request)
        }
    }

    fn body(&self, request: &Request, stream: bool) -> Value {
        let mut body = request.body.clone();
        body["model"] = json!(self.model);
        body["stream"] = json!(stream);
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    }

    /// The chat template the server reports on llama-server's `/props` (ember's too), if any.
    pub fn chat_template(&self) -> Option<String> {
        let response = http_client::request(
            &self.base,
            "GET",
            "/props",
            self.api_key.as_deref(),
            None,
            self.timeout,
        )
        .ok()?;
        if response.status != 200 {
            return None;
        }
        let props: Value = serde_json::from_str(&response.text().ok()?).ok()?;
        props["chat_template"].as_str().map(str::to_owned)
    }
}

/// Where two replies to what should be the same request part, naming each side; `None` when
/// they agree in reasoning, content and finish reason.
pub fn difference(a: (&str, &Reply), b: (&str, &Reply)) -> Option<String> {
    let ((a_name, a), (b_name, b)) = (a, b);
    for (field, x, y) in [
        ("reasoning_content", &a.reasoning, &b.reasoning),
        ("content", &a.content, &b.content),
    ] {
        if let Some(at) = first_difference(x, y) {
            return Some(format!(
                "{field} differs at char {at}: {a_name} {:?}, {b_name} {:?}",
                snippet(x, at),
                snippet(y, at)
            ));
        }
    }
    (a.finish_reason != b.finish_reason).then(|| {
        format!(
            "finish_reason: {a_name} {}, {b_name} {}",
            json!(a.finish_reason),
            json!(b.finish_reason)
        )
    })
}

/// The char offset where `a` and `b` first differ (one ending counts); `None` when equal.
pub fn first_difference(a: &str, b: &str) -> Option<usize> {
    if a == b {
        return None;
    }
    let same = a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count();
    Some(same)
}

/// A few chars of `text` around char offset `at`, to show where a mismatch is.
pub fn snippet(text: &str, at: usize) -> String {
    const BEFORE: usize = 12;
    const AFTER: usize = 28;
    let start = at.saturating_sub(BEFORE);
    let mut out: String = text.chars().skip(start).take(at - start + AFTER).collect();
    if start > 0 {
        out.insert(0, '…');
    }
    if text.chars().count() > at + AFTER {
        out.push('…');
    }
    out
}

/// Sends every request on its own thread, all released at the same moment (`streamed(i)` says
/// how to send the `i`th); the replies in order.
pub fn send_all_at_once(
    client: &Client,
    requests: &[Request],
    streamed: impl Fn(usize) -> bool + Sync,
) -> Vec<anyhow::Result<Reply>> {
    let start = std::sync::Barrier::new(requests.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = requests
            .iter()
            .enumerate()
            .map(|(i, request)| {
                let (start, streamed) = (&start, &streamed);
                s.spawn(move || {
                    start.wait();
                    client.send_as(request, streamed(i))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a request thread panicked")))
            })
            .collect()
    })
}
