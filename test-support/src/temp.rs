//! Unique paths in the temp directory: files for a child process's output or a test's
//! configuration, and directories that are removed when dropped. The names carry this
//! process's id and a sequence number, so tests running at once never share one.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// `lockbroker-test-{what}-{pid}-{n}`, unique within this test process.
fn unique_name(what: &str) -> String {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    format!(
        "lockbroker-test-{what}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// A unique path in the temp directory for a file with this extension (not created).
pub fn temp_file(what: &str, extension: &str) -> PathBuf {
    std::env::temp_dir().join(format!("{}.{extension}", unique_name(what)))
}

/// A unique path in the temp directory for a child process's output (not created).
pub fn temp_log(what: &str) -> PathBuf {
    temp_file(what, "log")
}

/// A directory of the test's own, for what the commands it runs write; removed when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(what: &str) -> Self {
        let dir = std::env::temp_dir().join(unique_name(what));
        std::fs::create_dir_all(&dir).expect("cannot create a temp directory");
        Self(dir)
    }

    pub fn dir(&self) -> &Path {
        &self.0
    }

    /// `name` inside the directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
