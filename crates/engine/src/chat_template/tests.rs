use super::*;
use serde_json::json;

/// A condensed Qwen3 template: namespace, messages[::-1], loop.index0/last,
/// startswith/split/strip, reasoning_content and enable_thinking.
const QWEN3_STYLE: &str = r#"{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role != "system" %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"#;

fn qwen() -> ChatTemplate {
    ChatTemplate::new(QWEN3_STYLE, None, Some("<|im_end|>".into())).unwrap()
}

fn no_kwargs() -> serde_json::Map<String, serde_json::Value> {
    serde_json::Map::new()
}

fn kwargs(v: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    v.as_object().cloned().unwrap()
}

#[test]
fn qwen3_single_turn() {
    let msgs = [
        ChatMessage::new("system", "You are helpful."),
        ChatMessage::new("user", "Hi!"),
    ];
    let out = qwen().render(&msgs, true, &no_kwargs()).unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are helpful.<|im_end|>\n\
             <|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    );
    let out = qwen()
        .render(&msgs, true, &kwargs(json!({"enable_thinking": false})))
        .unwrap();
    assert!(
        out.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{out:?}"
    );
    let out = qwen()
        .render(&msgs, false, &kwargs(json!({"enable_thinking": true})))
        .unwrap();
    assert!(
        out.ends_with("<|im_start|>user\nHi!<|im_end|>\n"),
        "{out:?}"
    );
}

#[test]
fn qwen3_multi_turn_reasoning() {
    let mut with_reasoning = ChatMessage::new("assistant", "The answer is 4.");
    with_reasoning.reasoning_content = Some("\n2+2=4\n".into());
    let msgs = [
        ChatMessage::new("user", "What is 1+1?"),
        ChatMessage::new("assistant", "<think>\nadd them\n</think>\n\n2"),
        ChatMessage::new("user", "And 2+2?"),
        with_reasoning,
    ];
    let out = qwen().render(&msgs, false, &no_kwargs()).unwrap();
    // Reasoning before the last user query is dropped; after it, kept.
    assert_eq!(
        out,
        "<|im_start|>user\nWhat is 1+1?<|im_end|>\n\
             <|im_start|>assistant\n2<|im_end|>\n\
             <|im_start|>user\nAnd 2+2?<|im_end|>\n\
             <|im_start|>assistant\n<think>\n2+2=4\n</think>\n\nThe answer is 4.<|im_end|>\n"
    );
}

#[test]
fn raise_exception_carries_the_message() {
    let msgs = [ChatMessage::new("robot", "beep")];
    match qwen().render(&msgs, true, &no_kwargs()) {
        Err(TemplateError::Raised(message)) => assert_eq!(message, "Unknown role: robot"),
        other => panic!("expected Raised, got {other:?}"),
    }
}

#[test]
fn syntax_and_render_errors_are_errors() {
    let err = ChatTemplate::new("{% for m in messages %}{{ m }", None, None).unwrap_err();
    assert!(matches!(err, TemplateError::Syntax(_)), "{err}");
    let err = ChatTemplate::new("{% if %}", None, None).unwrap_err();
    assert!(matches!(err, TemplateError::Syntax(_)), "{err}");

    let tpl = ChatTemplate::new("{{ messages[0].content.nope() }}", None, None).unwrap();
    let err = tpl.render(&[ChatMessage::new("user", "x")], false, &no_kwargs());
    assert!(matches!(err, Err(TemplateError::Render(_))), "{err:?}");

    let err = qwen().render(&[], false, &kwargs(json!({"messages": []})));
    assert!(matches!(err, Err(TemplateError::ReservedKwarg(k)) if k == "messages"));
}

#[test]
fn special_tokens_kwargs_and_whitespace_control() {
    let src = "{{ bos_token }}\n{% for m in messages %}\n  {% if loop.last %}\n[{{ m.role }}]{{ m.content }}\n  {% endif %}\n{% endfor %}\n{{ eos_token is defined }}|{{ tools is defined }}|{{ custom }}\n";
    let tpl = ChatTemplate::new(src, Some("<s>".into()), None).unwrap();
    let msgs = [ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
    let out = tpl
        .render(
            &msgs,
            false,
            &kwargs(json!({"custom": [1, "x", null, true]})),
        )
        .unwrap();
    // trim_blocks + lstrip_blocks; Python-style rendering of lists/None/bools;
    // no trailing newline kept.
    assert_eq!(out, "<s>\n[user]b\nFalse|False|[1, 'x', None, True]");
    let out = tpl
        .render(&msgs, false, &kwargs(json!({"bos_token": "<B>"})))
        .unwrap();
    assert!(out.starts_with("<B>\n"), "{out:?}");
}

#[test]
fn loop_controls_and_py_methods() {
    let src = "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}\
                   {% if m.role == 'stop' %}{% break %}{% endif %}{{ m.content.strip().upper() }},\
                   {% endfor %}{% for k, v in opts.items() %}{{ k }}={{ v }};{% endfor %}\
                   {{ 'a,b'.split(',') | length }}";
    let tpl = ChatTemplate::new(src, None, None).unwrap();
    let msgs = [
        ChatMessage::new("user", " a "),
        ChatMessage::new("skip", "b"),
        ChatMessage::new("user", "c"),
        ChatMessage::new("stop", "d"),
        ChatMessage::new("user", "e"),
    ];
    let out = tpl
        .render(&msgs, false, &kwargs(json!({"opts": {"z": 1, "a": 2}})))
        .unwrap();
    assert_eq!(out, "A,C,z=1;a=2;2");
}

#[test]
fn reasoning_content_is_omitted_when_none() {
    let tpl = ChatTemplate::new(
        "{% for m in messages %}{{ m.reasoning_content is defined }}{% endfor %}",
        None,
        None,
    )
    .unwrap();
    let mut m = ChatMessage::new("assistant", "x");
    let out = tpl
        .render(std::slice::from_ref(&m), false, &no_kwargs())
        .unwrap();
    assert_eq!(out, "False");
    m.reasoning_content = Some("r".into());
    assert_eq!(tpl.render(&[m], false, &no_kwargs()).unwrap(), "True");
}

fn render_with(src: &str, kw: serde_json::Value) -> Result<String, TemplateError> {
    ChatTemplate::new(src, None, None)?.render(&[], false, &kwargs(kw))
}

#[test]
fn tojson_matches_python_json_dumps() {
    let tool = json!({"tool": {"name": "f<&>'", "z": 1, "a": [1.5, 1e-7, 1e16, 100.0, -0.0],
                                   "u": "é\n\"\\\u{1}", "e": {}, "l": [], "n": null, "b": false}});
    let out = render_with("{{ tool | tojson }}", tool.clone()).unwrap();
    assert_eq!(
        out,
        r#"{"name": "f<&>'", "z": 1, "a": [1.5, 1e-07, 1e+16, 100.0, -0.0], "u": "é\n\"\\\u0001", "e": {}, "l": [], "n": null, "b": false}"#
    );
    let out = render_with("{{ tool | tojson(indent=2) }}", tool.clone()).unwrap();
    assert_eq!(
        out,
        "{\n  \"name\": \"f<&>'\",\n  \"z\": 1,\n  \"a\": [\n    1.5,\n    1e-07,\n    1e+16,\n    100.0,\n    -0.0\n  ],\n  \"u\": \"é\\n\\\"\\\\\\u0001\",\n  \"e\": {},\n  \"l\": [],\n  \"n\": null,\n  \"b\": false\n}"
    );
    let out = render_with(
            "{{ tool.u | tojson(ensure_ascii=true) }} {{ {'b': 1, 'a': 2} | tojson(sort_keys=true, separators=[',', ':']) }}",
            tool,
        )
        .unwrap();
    assert_eq!(out, r#""\u00e9\n\"\\\u0001" {"a":2,"b":1}"#);
    assert!(render_with("{{ nope | tojson }}", json!({})).is_err());
    assert!(render_with("{{ 1 | tojson(bogus=1) }}", json!({})).is_err());
    assert_eq!(
        render_with("{{ '🙂' | tojson(true) }}", json!({})).unwrap(),
        r#""\ud83d\ude42""#
    );
}

#[test]
fn newlines_and_numbers_print_as_in_python() {
    // jinja2 normalises the source's \r\n and \r to \n.
    let out = render_with(
        "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc\rd\r\n",
        json!({}),
    );
    assert_eq!(out.unwrap(), "a\nb\nc\nd");
    let out = render_with(
        "{{ x }} {{ y }} {{ z }} {{ n }}",
        json!({"x": 1e-7, "y": 1e20, "z": 2.5, "n": 7}),
    );
    assert_eq!(out.unwrap(), "1e-07 1e+20 2.5 7");
}

#[test]
fn python_float_repr() {
    let cases = [
        (0.0, "0.0"),
        (1.0, "1.0"),
        (0.1, "0.1"),
        (1.5e-5, "1.5e-05"),
        (0.0001, "0.0001"),
        (123456789.125, "123456789.125"),
        (1e15, "1000000000000000.0"),
        (1e16, "1e+16"),
        (1.2345e20, "1.2345e+20"),
        (-2.5e-300, "-2.5e-300"),
        (f64::MAX, "1.7976931348623157e+308"),
        (5e-324, "5e-324"),
        (0.30000000000000004, "0.30000000000000004"),
    ];
    for (x, want) in cases {
        assert_eq!(py_float_repr(x), want, "{x:e}");
    }
}

#[test]
fn strftime_now_renders_the_local_date() {
    // Through the template, against the real clock: only the shape is stable.
    let out = render_with("{{ strftime_now('%Y-%m-%d') }}", json!({})).unwrap();
    assert_eq!(out.len(), 10, "{out}");
    assert!(out.starts_with("20"), "{out}");
}
