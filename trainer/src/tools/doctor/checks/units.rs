//! Sizes and counts as the findings write them.

/// `1536` as `1.5 KiB`: whole KiB below 1 MiB, one decimal above.
pub fn size(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if bytes < 1 << 10 {
        format!("{bytes} B")
    } else if bytes < 1 << 20 {
        format!("{:.0} KiB", b / KIB)
    } else if bytes < 1 << 30 {
        format!("{:.1} MiB", b / KIB / KIB)
    } else {
        format!("{:.1} GiB", b / KIB / KIB / KIB)
    }
}

/// `3 ranks`, `1 rank`.
pub fn plural(n: usize, word: &str) -> String {
    format!("{n} {word}{}", if n == 1 { "" } else { "s" })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn sizes_read_naturally() {
        assert_eq!(size(512), "512 B");
        assert_eq!(size(64 << 10), "64 KiB");
        assert_eq!(size(8 * MIB + 8192), "8.0 MiB");
        assert_eq!(size(3 << 29), "1.5 GiB");
    }
}
