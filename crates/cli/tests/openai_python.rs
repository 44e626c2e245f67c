//! The official `openai` Python package against the real server (tests/openai_client.py).
//! Skipped with a loud message when the package is missing, unless `CI` is set.

mod common;

use std::process::Command;

use common::{Server, TempFile};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/openai_client.py");

fn openai_available() -> bool {
    Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|out| out.status.success())
}

#[test]
fn the_openai_python_client_works_against_the_server() {
    if !openai_available() {
        if std::env::var_os("CI").is_some() {
            panic!("python3 cannot import openai; CI must install it (pip install openai)");
        }
        eprintln!();
        eprintln!("**********************************************************************");
        eprintln!("SKIPPED openai_python: python3 cannot `import openai`.");
        eprintln!("Install it with `pip install openai` to run this test.");
        eprintln!("**********************************************************************");
        eprintln!();
        return;
    }
    let keys = TempFile::new("openai-keys", "sk-ember-python-test\n");
    let server = Server::start(
        "llama-f32",
        &["--api-keys-file", keys.path().to_str().unwrap()],
    );
    let out = Command::new("python3")
        .arg(SCRIPT)
        .args(["--base-url", &format!("{}/v1", server.base_url())])
        .args(["--api-key", "sk-ember-python-test"])
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .output()
        .expect("running python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(" passed, 0 failed"),
        "openai_client.py failed ({:?})\nstdout:\n{stdout}\nstderr:\n{stderr}\nserver log:\n{}",
        out.status,
        server.log()
    );
    eprintln!("{stdout}");
}
