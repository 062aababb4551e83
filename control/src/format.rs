//! Human-readable output: byte sizes and aligned text tables. Pure functions,
//! shared by the daemon's error messages and phubctl.

/// Formats a byte count with a binary unit: `512 B`, `1.5 KiB`, `12.5 MiB`,
/// `3.0 GiB`, `1.2 TiB` (one decimal above bytes).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// Formats a duration in milliseconds: `850 ms`, `12.3 s`, `4.5 min`, `2.0 h`.
pub fn human_ms(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms} ms")
    } else if ms < 120_000 {
        format!("{:.1} s", ms as f64 / 1000.0)
    } else if ms < 7_200_000 {
        format!("{:.1} min", ms as f64 / 60_000.0)
    } else {
        format!("{:.1} h", ms as f64 / 3_600_000.0)
    }
}

/// How a column's cells are aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Text: padded on the right.
    Left,
    /// Numbers: padded on the left.
    Right,
}

/// Renders a table: a header line and one line per row, columns separated by
/// two spaces, each as wide as its widest cell (counted in characters), cells
/// aligned as `columns` says (header cells too). Lines carry no trailing
/// spaces and each ends with a newline. A row shorter than the header is
/// padded with empty cells; extra cells are ignored.
pub fn table(columns: &[(&str, Align)], rows: &[Vec<String>]) -> String {
    let n = columns.len();
    let cell = |row: &[String], i: usize| row.get(i).map(String::as_str).unwrap_or("").to_string();
    let header: Vec<String> = columns.iter().map(|(h, _)| (*h).to_string()).collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, w) in widths.iter_mut().enumerate() {
            *w = (*w).max(cell(row, i).chars().count());
        }
    }
    let mut out = String::new();
    for line in std::iter::once(&header).chain(rows.iter()) {
        let mut text = String::new();
        for i in 0..n {
            let c = cell(line, i);
            let pad = widths[i] - c.chars().count();
            if i > 0 {
                text.push_str("  ");
            }
            match columns[i].1 {
                Align::Left => {
                    text.push_str(&c);
                    text.extend(std::iter::repeat_n(' ', pad));
                }
                Align::Right => {
                    text.extend(std::iter::repeat_n(' ', pad));
                    text.push_str(&c);
                }
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1024), "1.0 KiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(12 * 1024 * 1024 + 512 * 1024), "12.5 MiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
        assert_eq!(human_bytes(u64::MAX), "16384.0 PiB");
    }

    #[test]
    fn durations() {
        assert_eq!(human_ms(850), "850 ms");
        assert_eq!(human_ms(12_345), "12.3 s");
        assert_eq!(human_ms(270_000), "4.5 min");
        assert_eq!(human_ms(7_200_000), "2.0 h");
    }

    #[test]
    fn tables_align_text_left_and_numbers_right() {
        let t = table(
            &[
                ("ID", Align::Right),
                ("NAME", Align::Left),
                ("MEMORY", Align::Right),
            ],
            &[
                vec!["1".into(), "resnet50".into(), "12.5 MiB".into()],
                vec!["12".into(), "bert".into(), "1.0 GiB".into()],
            ],
        );
        assert_eq!(
            t,
            "ID  NAME        MEMORY\n\
             \x201  resnet50  12.5 MiB\n\
             12  bert       1.0 GiB\n"
        );
    }

    #[test]
    fn tables_handle_short_rows_wide_chars_and_no_rows() {
        let t = table(&[("A", Align::Left), ("B", Align::Left)], &[vec!["héllo".into()]]);
        assert_eq!(t, "A      B\nhéllo\n");
        let t = table(&[("LCORE", Align::Right), ("RX", Align::Right)], &[]);
        assert_eq!(t, "LCORE  RX\n");
        let t = table(&[("X", Align::Right)], &[vec!["1".into(), "extra".into()]]);
        assert_eq!(t, "X\n1\n");
    }
}
