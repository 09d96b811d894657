//! A started worker's last lines of output, kept so that a worker that exits before it
//! answers can say why: read back from its log file (`log_dir`), or kept from its output
//! pipes, bounded, when the workers stop with the gateway (without a state file: a worker a
//! later gateway may adopt must not write into a pipe nobody reads).

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt};

/// Lines kept.
pub const LINES: usize = 20;
/// Longest line kept, bytes (the rest is cut).
const LINE_BYTES: usize = 1024;

/// Where a worker's output can be read back.
#[derive(Debug, Clone)]
pub enum Output {
    /// Its log file.
    File(PathBuf),
    /// Its pipes' last lines.
    Kept(Arc<Mutex<VecDeque<String>>>),
    /// Nowhere (it writes to /dev/null).
    Lost,
}

impl Output {
    /// Keeps the last lines `stdout` and `stderr` write, until both close.
    pub fn keep(stdout: Option<impl AsyncRead + Unpin + Send + 'static>, stderr: Option<impl AsyncRead + Unpin + Send + 'static>) -> Self {
        let lines = Arc::new(Mutex::new(VecDeque::with_capacity(LINES)));
        if let Some(out) = stdout {
            tokio::spawn(follow(out, lines.clone()));
        }
        if let Some(err) = stderr {
            tokio::spawn(follow(err, lines.clone()));
        }
        Self::Kept(lines)
    }

    /// Its last lines, oldest first (empty when nothing was kept).
    pub fn last_lines(&self) -> Vec<String> {
        match self {
            Self::File(path) => tail_of(path),
            Self::Kept(lines) => lines.lock().iter().cloned().collect(),
            Self::Lost => Vec::new(),
        }
    }
}

/// Reads `pipe` to its end, keeping its last lines. A line ends at `\n` or `\r` (progress bars
/// redraw a line with `\r` and may never end it): the line being read is never held past
/// `LINE_BYTES`, whatever the worker writes.
async fn follow(mut pipe: impl AsyncRead + Unpin, lines: Arc<Mutex<VecDeque<String>>>) {
    let mut chunk = [0u8; 4096];
    let mut line = Vec::with_capacity(LINE_BYTES);
    loop {
        let n = match pipe.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        for &b in &chunk[..n] {
            if b == b'\n' || b == b'\r' {
                if !line.is_empty() {
                    push(&mut lines.lock(), &line);
                    line.clear();
                }
            } else if line.len() < LINE_BYTES {
                line.push(b);
            }
        }
    }
    if !line.is_empty() {
        push(&mut lines.lock(), &line);
    }
}

fn push(lines: &mut VecDeque<String>, raw: &[u8]) {
    let raw = &raw[..raw.len().min(LINE_BYTES)];
    let line = String::from_utf8_lossy(raw).trim_end().to_string();
    if lines.len() == LINES {
        lines.pop_front();
    }
    lines.push_back(line);
}

/// The last lines of the file at `path` (its last 64 KiB read).
fn tail_of(path: &Path) -> Vec<String> {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else { return Vec::new() };
    let len = f.metadata().map_or(0, |m| m.len());
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut raw = Vec::new();
    let _ = f.read_to_end(&mut raw);
    let mut lines = VecDeque::with_capacity(LINES);
    for line in raw.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        push(&mut lines, line);
    }
    lines.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_the_last_lines_are_kept_and_long_ones_are_cut() {
        let text: String = (0..30).map(|i| ["line ", &i.to_string(), "\n"].concat()).collect::<String>() + &"x".repeat(5000);
        let out = Output::keep(Some(std::io::Cursor::new(text.into_bytes())), None::<tokio::io::Empty>);
        let got = loop {
            let got = out.last_lines();
            if got.last().is_some_and(|l| l.starts_with('x')) {
                break got;
            }
            tokio::task::yield_now().await;
        };
        assert_eq!(got.len(), LINES);
        assert_eq!(got[0], "line 11");
        assert_eq!(got[LINES - 1].len(), LINE_BYTES);
    }

    #[tokio::test]
    async fn a_progress_bar_redrawn_with_carriage_returns_is_lines_not_one_growing_buffer() {
        let text: String = (0..=100).map(|p| ["\rloading ", &p.to_string(), "%"].concat()).collect::<String>() + "\nready\n";
        let out = Output::keep(Some(std::io::Cursor::new(text.into_bytes())), None::<tokio::io::Empty>);
        let got = loop {
            let got = out.last_lines();
            if got.last().is_some_and(|l| l == "ready") {
                break got;
            }
            tokio::task::yield_now().await;
        };
        assert_eq!(got.len(), LINES);
        assert_eq!(got[LINES - 2], "loading 100%");
    }

    #[test]
    fn a_log_files_tail_is_read_back() {
        let path = std::env::temp_dir().join(format!("kvgate-output-{}.log", std::process::id()));
        std::fs::write(&path, (0..50).map(|i| ["l", &i.to_string(), "\n"].concat()).collect::<String>()).unwrap();
        let got = Output::File(path.clone()).last_lines();
        let _ = std::fs::remove_file(&path);
        assert_eq!(got.len(), LINES);
        assert_eq!((got[0].as_str(), got[LINES - 1].as_str()), ("l30", "l49"));
        assert!(Output::Lost.last_lines().is_empty());
    }
}
