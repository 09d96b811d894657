//! What `/proc` says about a process under test: its family (a master and its workers, as
//! nginx runs), resident memory and open descriptors.

/// `pid` and every process whose parent is `pid` (nginx: its master and its workers).
pub fn family(pid: u32) -> Vec<u32> {
    let mut all = vec![pid];
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            // The parent is the second field after the name, which may hold spaces or ')'.
            let ppid = std::fs::read_to_string(format!("/proc/{child}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1).and_then(|v| v.parse::<u32>().ok())));
            if ppid == Some(pid) {
                all.push(child);
            }
        }
    }
    all
}

/// Resident memory of `pid`'s family, in KiB (0 for one that is gone).
pub fn rss_kib(pid: u32) -> u64 {
    family(pid).into_iter().map(|p| status_kib(p, "VmRSS:")).sum()
}

/// Open file descriptors of `pid`'s family.
pub fn fds(pid: u32) -> usize {
    family(pid).into_iter().map(|p| std::fs::read_dir(format!("/proc/{p}/fd")).map_or(0, Iterator::count)).sum()
}

/// A `kB` line of `/proc/<pid>/status`.
fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_memory_and_descriptors() {
        let me = std::process::id();
        assert!(rss_kib(me) > 0);
        assert!(fds(me) >= 3);
        assert_eq!(family(me)[0], me);
    }
}
