//! A chat whose last message is the assistant's is continued, not closed: its prompt is the
//! chat up to that message's text, as the same chat without it prompts a new reply, followed by
//! the text (llama-server's assistant prefill, vLLM's `continue_final_message`).

use std::path::PathBuf;

use ember_engine::chat_template::ChatMessage;
use ember_engine::{Engine, EngineOptions};

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(name)
}

#[test]
fn a_final_assistant_message_is_continued() {
    for name in ["llama-f32", "qwen3-f32", "qwen2-f32"] {
        let engine = Engine::load(&golden(name), &EngineOptions::default()).unwrap();
        let encoder = engine.encoder();
        let kwargs = serde_json::Map::new();
        let user = ChatMessage::new("user", "Tell me a story.");
        let new_reply = encoder
            .render_chat_continuing(std::slice::from_ref(&user), &kwargs)
            .unwrap();
        let prefill = ChatMessage::new("assistant", "Once upon a time");
        let continued = encoder
            .render_chat_continuing(&[user.clone(), prefill], &kwargs)
            .unwrap();
        assert!(
            continued.ends_with("Once upon a time"),
            "{name}: the prompt ends with the prefill: {continued:?}"
        );
        if name == "qwen3-f32" {
            // Qwen3's template closes an empty reasoning block before a final reply.
            assert!(continued.starts_with(&new_reply), "{name}: {continued:?}");
        } else {
            assert_eq!(continued, format!("{new_reply}Once upon a time"), "{name}");
        }
        // An empty prefill: the prompt of a new reply.
        let empty = ChatMessage::new("assistant", "");
        let same = encoder
            .render_chat_continuing(&[user, empty], &kwargs)
            .unwrap();
        assert_eq!(same, new_reply, "{name}");
        println!("{name}: {continued:?}");
    }
}
