use std::path::Path;

use serde::de::DeserializeOwned;

use crate::error::{CheckpointError, Result};

/// Reads and parses a JSON file; errors name the file, and serde's message names the field.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|source| CheckpointError::Io {
        path: path.into(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| CheckpointError::Json {
        path: path.into(),
        message: e.to_string(),
    })
}
