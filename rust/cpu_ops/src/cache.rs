//! What the core's caches hold, for the kernels that size a buffer to stay in one: read once
//! from Linux's description of CPU 0's caches (`/sys/devices/system/cpu/cpu0/cache`), with a
//! small default where it cannot be read (another OS, a sandbox without `/sys`).
//!
//! Why not one constant: the machines kvpark runs on differ fourfold here (256 KiB to 2 MiB of
//! L2 a core), and a buffer sized for the smallest leaves the others' caches unused while one
//! sized for the largest spills the others' (`attention/block.rs` measured both).

use std::path::Path;
use std::sync::OnceLock;

/// The L2 assumed where the system does not say: the smaller of today's x86 server cores'.
const DEFAULT_L2_BYTES: usize = 512 * 1024;

/// The unified (or data) L2 cache of CPU 0, in bytes.
pub(crate) fn l2_bytes() -> usize {
    static L2: OnceLock<usize> = OnceLock::new();
    *L2.get_or_init(|| {
        read_l2(Path::new("/sys/devices/system/cpu/cpu0/cache")).unwrap_or(DEFAULT_L2_BYTES)
    })
}

/// The level-2 data or unified cache's size among `dir`'s `index*` entries, if one is there.
fn read_l2(dir: &Path) -> Option<usize> {
    let read = |entry: &Path, name: &str| std::fs::read_to_string(entry.join(name)).ok();
    std::fs::read_dir(dir).ok()?.flatten().find_map(|entry| {
        let path = entry.path();
        let level = read(&path, "level")?;
        let kind = read(&path, "type")?;
        let wanted = level.trim() == "2" && matches!(kind.trim(), "Unified" | "Data");
        wanted.then(|| parse_size(&read(&path, "size")?)).flatten()
    })
}

/// A sysfs cache size (`2048K`, `1M`, `512`) in bytes; `None` for anything else or zero.
fn parse_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let scale = match unit {
        "" => 1,
        "K" => 1024,
        "M" => 1024 * 1024,
        _ => return None,
    };
    digits
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
        .map(|n| n * scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_size("2048K\n"), Some(2 << 20));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("0K"), None);
        assert_eq!(parse_size("2G"), None);
        assert_eq!(parse_size(""), None);
    }

    #[test]
    fn the_l2_entry_is_found_among_the_others() {
        let dir = std::env::temp_dir().join(format!("kvpark-cache-{}", std::process::id()));
        let entries = [
            ("index0", "1", "Data", "48K"),
            ("index1", "1", "Instruction", "32K"),
            ("index2", "2", "Unified", "1280K"),
            ("index3", "3", "Unified", "30720K"),
        ];
        for (name, level, kind, size) in entries {
            let e = dir.join(name);
            std::fs::create_dir_all(&e).unwrap();
            std::fs::write(e.join("level"), format!("{level}\n")).unwrap();
            std::fs::write(e.join("type"), format!("{kind}\n")).unwrap();
            std::fs::write(e.join("size"), format!("{size}\n")).unwrap();
        }
        assert_eq!(read_l2(&dir), Some(1280 * 1024));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(read_l2(&dir), None);
        // whatever this machine says, a size in a sane range
        assert!(
            (64 * 1024..=64 << 20).contains(&l2_bytes()),
            "{}",
            l2_bytes()
        );
    }
}
