//! Helpers shared by the tests that load broken checkpoints.

use std::path::Path;

use ember_engine::{Engine, EngineOptions};

/// The message of the error loading `path` fails with (panics if it loads).
pub fn load_error(path: &Path) -> String {
    let options = EngineOptions {
        threads: Some(1),
        context: Some(16),
        prefill_chunk: Some(4),
        ..EngineOptions::default()
    };
    match Engine::load(path, &options) {
        Ok(_) => panic!("{} loaded, but should have failed", path.display()),
        Err(e) => e.to_string(),
    }
}

/// Asserts that `message` names every one of `parts`.
pub fn assert_names(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(
            message.contains(part),
            "error message {message:?} should name {part:?}"
        );
    }
}
