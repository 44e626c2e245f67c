//! Tool calls through the real server, on a copy of a golden fixture whose chat template
//! teaches Hermes `<tool_call>` blocks (tests/fixtures/tools_template.jinja): the tools reach
//! the template, required and named calls come back as `tool_calls` whose arguments fit their
//! schemas (whole and streamed), a call and its result go back as history, a template without
//! a tool format is a 400; then the official `openai` package does the same
//! (tests/openai_tools.py).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{Server, assert_error_shape, fixture, ok, with};
use serde_json::{Value, json};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/openai_tools.py");

/// qwen3-f32 with the tools template, in a folder of its own (removed on drop).
struct ToolsModel(PathBuf);

impl ToolsModel {
    fn new() -> ToolsModel {
        // One folder per test: tests run at once, and rewriting a model file that another
        // server has mapped would pull it from under that server.
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ember-tools-model-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        for entry in std::fs::read_dir(fixture("qwen3-f32")).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
        let template =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tools_template.jinja");
        std::fs::copy(template, dir.join("chat_template.jinja")).unwrap();
        ToolsModel(dir)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for ToolsModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 12},
                "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    ])
}

fn chat(extra: Value) -> Value {
    let body = json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": tools(),
        "max_tokens": 120,
        "temperature": 0,
    });
    with(body, extra)
}

fn assert_weather_arguments(arguments: &str) {
    let args: Value =
        serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{arguments}: {e}"));
    let object = args.as_object().expect("an object");
    assert_eq!(object.len(), 2, "{arguments}");
    assert!(
        ["c", "f"].contains(&object["unit"].as_str().unwrap()),
        "{arguments}"
    );
    let city = object["city"].as_str().unwrap();
    assert!((1..=12).contains(&city.chars().count()), "{arguments}");
}

#[test]
fn required_and_named_calls_come_back_as_tool_calls() {
    let model = ToolsModel::new();
    let server = Server::start(model.path(), &[]);
    // The tools reach the template.
    let prompt = ok(&server, "/apply-template", &chat(json!({})))["prompt"].clone();
    assert!(
        prompt
            .as_str()
            .unwrap()
            .contains("\"name\": \"get_weather\""),
        "{prompt}"
    );

    // One call (a random model offered more might go on calling until the token limit).
    let r = ok(
        &server,
        "/v1/chat/completions",
        &chat(json!({"tool_choice": "required", "parallel_tool_calls": false})),
    );
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    assert_eq!(choice["message"]["content"], Value::Null, "{r}");
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .expect("tool_calls");
    assert!(!calls.is_empty());
    for call in calls {
        assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
        assert_eq!(call["type"], "function");
        let arguments = call["function"]["arguments"].as_str().unwrap();
        match call["function"]["name"].as_str().unwrap() {
            "get_weather" => assert_weather_arguments(arguments),
            "now" => assert!(
                serde_json::from_str::<Value>(arguments)
                    .unwrap()
                    .is_object()
            ),
            other => panic!("a call of {other}"),
        }
    }

    // Named, and not parallel: exactly one call of it.
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                       "parallel_tool_calls": false});
    let r = ok(&server, "/v1/chat/completions", &chat(named.clone()));
    let calls = r["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(calls.len(), 1, "{r}");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_weather_arguments(calls[0]["function"]["arguments"].as_str().unwrap());

    // Streamed: the same call as one `delta.tool_calls` piece, then finish_reason tool_calls.
    let mut body = chat(named);
    body["stream"] = json!(true);
    let chunks: Vec<Value> = server
        .stream_json("/v1/chat/completions", &body)
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let pieces: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(pieces.len(), 1, "{chunks:?}");
    assert_eq!(pieces[0][0]["index"], 0);
    assert_eq!(
        pieces[0][0]["function"], calls[0]["function"],
        "stream and whole differ"
    );
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(
        !content.contains("<tool_call>"),
        "a call leaked into content: {content:?}"
    );
}

#[test]
fn a_call_and_its_result_go_back_as_history() {
    let model = ToolsModel::new();
    let server = Server::start(model.path(), &[]);
    let history = json!([
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}
    ]);
    let prompt = ok(
        &server,
        "/apply-template",
        &chat(json!({"messages": history})),
    )["prompt"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        prompt.contains(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>"
        ),
        "{prompt}"
    );
    assert!(
        prompt.contains("<tool_response>\n18 C and sunny\n</tool_response>"),
        "{prompt}"
    );
    let r = ok(
        &server,
        "/v1/chat/completions",
        &chat(json!({"messages": history, "max_tokens": 8})),
    );
    assert!(r["choices"][0]["finish_reason"].is_string(), "{r}");

    // Bad history and bad tools are 400s naming the field.
    for (extra, param) in [
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
                   "function": {"name": "f", "arguments": "{not json"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "missing"}}}),
            "tool_choice",
        ),
        (
            json!({"tool_choice": "required", "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
    ] {
        let (status, body) = server.post_json("/v1/chat/completions", &chat(extra.clone()));
        assert_eq!(status, 400, "{extra}: {body}");
        assert_error_shape(&body);
        assert_eq!(body["error"]["param"], param, "{body}");
    }
}

#[test]
fn a_template_without_a_tool_format_is_a_clear_400() {
    let server = Server::start("qwen3-f32", &[]);
    let (status, body) = server.post_json("/v1/chat/completions", &chat(json!({})));
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "tools");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tool-call format")
    );
    // `tool_choice: none` asks for text: the tools are not needed.
    let r = ok(
        &server,
        "/v1/chat/completions",
        &chat(json!({"tool_choice": "none", "max_tokens": 4})),
    );
    assert_eq!(r["choices"][0]["finish_reason"], "length");
}

#[test]
fn the_openai_python_client_calls_tools() {
    let available = Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !available {
        assert!(
            std::env::var_os("CI").is_none(),
            "python3 cannot import openai; CI must install it (pip install openai)"
        );
        eprintln!("SKIPPED: python3 cannot `import openai` (pip install openai)");
        return;
    }
    let model = ToolsModel::new();
    let server = Server::start(model.path(), &[]);
    let out = Command::new("python3")
        .arg(SCRIPT)
        .args(["--base-url", &format!("{}/v1", server.base_url())])
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .output()
        .expect("running python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(" passed, 0 failed"),
        "openai_tools.py failed\nstdout:\n{stdout}\nstderr:\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.log()
    );
}
