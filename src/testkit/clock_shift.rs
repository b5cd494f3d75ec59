//! A wall clock a test can step: `clock_shift.c`, built here with the C compiler and preloaded
//! into a process, adds to CLOCK_REALTIME the microseconds written in a file the test rewrites.
//! Used to step Redis's clock (`TIME`, and the time scripts read) while it runs.

use super::TempDir;
use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = include_str!("clock_shift.c");

/// The preload library and the file holding the shift.
pub struct ClockShift {
    _dir: TempDir,
    lib: PathBuf,
    file: PathBuf,
}

impl ClockShift {
    /// Builds the library (`cc`, which every Rust toolchain on Linux links with) with a shift of 0.
    pub fn build() -> ClockShift {
        let dir = TempDir::new("clock-shift");
        let source = dir.write("clock_shift.c", SOURCE);
        let lib = dir.path().join("clock_shift.so");
        let status = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&lib)
            .arg(&source)
            .status()
            .expect("running cc (the C compiler Rust links with)");
        assert!(status.success(), "cc could not build {}", source.display());
        let file = dir.write("shift", "0");
        ClockShift {
            _dir: dir,
            lib,
            file,
        }
    }

    /// Sets the shift from the real clock, in milliseconds (negative: behind). Written to a new
    /// file and renamed over the old, so a reader never sees half a number.
    pub fn set_ms(&self, ms: i64) {
        let tmp = self.file.with_extension("tmp");
        std::fs::write(&tmp, (ms * 1000).to_string()).expect("writing the clock shift");
        std::fs::rename(&tmp, &self.file).expect("replacing the clock shift");
    }

    /// The environment that puts a process under this shift.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".into(), self.lib.display().to_string()),
            (
                "PACER_CLOCK_SHIFT_FILE".into(),
                self.file.display().to_string(),
            ),
        ]
    }
}
