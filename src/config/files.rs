//! Reading the files a config names (the config itself, password files, certificates), each up
//! to a bound on its size: the config or a password named as `/dev/zero`, or a file that keeps
//! growing, took 1 GB a second until the OOM killer came (found by review).

use std::fmt;
use std::io::Read;
use std::path::Path;

/// The most the config file may hold: three times a config of 100,000 routes.
pub const CONFIG_MAX: u64 = 16 << 20;
/// The most a password file may hold.
pub const SECRET_MAX: u64 = 64 << 10;
/// The most a PEM file may hold: a system's whole CA bundle is about 200 KB.
pub const PEM_MAX: u64 = 4 << 20;

/// Why a file could not be read.
#[derive(Debug)]
pub enum ReadError {
    Io(std::io::Error),
    /// It holds more than the bound (in bytes).
    TooLarge(u64),
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Io(e) => e.fmt(f),
            ReadError::TooLarge(max) => write!(f, "it holds more than {} bytes", max),
        }
    }
}

/// The bytes of the file at `path`, if it holds at most `max` of them.
pub fn read(path: &Path, max: u64) -> Result<Vec<u8>, ReadError> {
    let file = std::fs::File::open(path).map_err(ReadError::Io)?;
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(ReadError::Io)?;
    if bytes.len() as u64 > max {
        return Err(ReadError::TooLarge(max));
    }
    Ok(bytes)
}

/// As [`read`], as UTF-8 text.
pub fn read_text(path: &Path, max: u64) -> Result<String, ReadError> {
    String::from_utf8(read(path, max)?).map_err(|_| {
        ReadError::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "stream did not contain valid UTF-8",
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endless_file_is_refused_at_its_bound() {
        let e = read(Path::new("/dev/zero"), 1000).unwrap_err();
        assert_eq!(e.to_string(), "it holds more than 1000 bytes");
        let dir = std::env::temp_dir().join(format!("pacer-file-{}", std::process::id()));
        std::fs::write(&dir, b"exactly").unwrap();
        assert_eq!(read(&dir, 7).unwrap(), b"exactly");
        assert!(matches!(read(&dir, 6), Err(ReadError::TooLarge(6))));
        std::fs::remove_file(&dir).unwrap();
    }
}
