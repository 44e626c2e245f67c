//! Helpers shared by the tests that load broken or unusual checkpoints.
// Each test crate that includes this module uses part of it.
#![allow(dead_code)]

use std::ops::Deref;
use std::path::{Path, PathBuf};

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

/// A file or directory under the system's temporary directory, named for this test process,
/// removed when dropped (a failed test's too: its panic unwinds through the drop).
pub struct Scratch(PathBuf);

impl Scratch {
    /// `ember-{stem}-{pid}{suffix}` in the temporary directory (a suffix such as `.gguf`, or
    /// none); nothing is created.
    pub fn new(stem: &str, suffix: &str) -> Self {
        let file = format!("ember-{stem}-{}{suffix}", std::process::id());
        Scratch(std::env::temp_dir().join(file))
    }
}

impl Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // Whichever it became; a path never created is no error.
        let _ = std::fs::remove_dir_all(&self.0);
        let _ = std::fs::remove_file(&self.0);
    }
}
