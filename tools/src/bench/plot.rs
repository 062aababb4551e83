//! The sweep plot: round time and goodput against the swept variable, as a
//! self-contained SVG written by hand (no plotting crate, no fonts needed
//! to write it; viewers use their own sans-serif). `.png` renders that same
//! SVG (`png.rs`, with phub-tools' `png` feature; a build without it says
//! so and asks for `.svg`).

use std::fmt::Write as _;
use std::path::Path;

#[cfg(not(feature = "png"))]
use anyhow::anyhow;
use anyhow::{bail, Context, Result};

use super::run::{RunResult, Sweep, SweepVariable};

/// One series of points.
struct Series<'a> {
    name: &'a str,
    color: &'a str,
    dashed: bool,
    points: Vec<(f64, f64)>,
}

/// "Nice" tick values covering [lo, hi].
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| span / s <= 6.0)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).floor() * step;
    let mut v = Vec::new();
    while t <= hi + step * 1e-9 {
        v.push(t);
        t += step;
    }
    v
}

fn fmt_num(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.abs() >= 100.0 || x.fract() == 0.0 {
        format!("{x:.0}")
    } else if x.abs() >= 1.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// Draws one panel at (x0, y0) of size (w, h).
#[allow(clippy::too_many_arguments)]
fn panel(
    svg: &mut String,
    x0: f64,
    y0: f64,
    w: f64,
    h: f64,
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[Series<'_>],
) {
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut xmin, mut xmax, mut ymax) = (f64::INFINITY, f64::NEG_INFINITY, 0f64);
    for &(x, y) in pts {
        xmin = xmin.min(x);
        xmax = xmax.max(x);
        ymax = ymax.max(y);
    }
    if !xmin.is_finite() {
        return;
    }
    if xmax == xmin {
        xmin -= 1.0;
        xmax += 1.0;
    }
    let integral = series
        .iter()
        .flat_map(|s| s.points.iter())
        .all(|p| p.0.fract() == 0.0);
    let mut xt = ticks(xmin, xmax);
    if integral {
        // Workers and lcores come in whole numbers: no 1.5 tick.
        xt.retain(|t| t.fract() == 0.0);
        if xt.len() < 2 {
            xt = vec![xmin.floor(), xmax.ceil()];
        }
    }
    let yt = ticks(0.0, ymax.max(1e-9) * 1.05);
    let (xlo, xhi) = (xt[0].min(xmin), xt.last().copied().unwrap_or(xmax).max(xmax));
    let yhi = yt.last().copied().unwrap_or(ymax).max(ymax);
    let (pl, pr, pt, pb) = (60.0, 15.0, 30.0, 45.0);
    let (iw, ih) = (w - pl - pr, h - pt - pb);
    let sx = |x: f64| x0 + pl + (x - xlo) / (xhi - xlo).max(1e-12) * iw;
    let sy = |y: f64| y0 + pt + ih - y / yhi.max(1e-12) * ih;
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" font-size="14" text-anchor="middle" font-weight="bold">{title}</text>"#,
        x0 + pl + iw / 2.0,
        y0 + 18.0
    );
    for &t in &yt {
        let y = sy(t);
        let _ = writeln!(
            svg,
            r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"##,
            x0 + pl,
            x0 + pl + iw,
            x0 + pl - 5.0,
            y + 4.0,
            fmt_num(t)
        );
    }
    for &t in &xt {
        if t < xlo - 1e-9 || t > xhi + 1e-9 {
            continue;
        }
        let x = sx(t);
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#ddd"/><text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"##,
            y0 + pt,
            y0 + pt + ih,
            y0 + pt + ih + 15.0,
            fmt_num(t)
        );
    }
    // The frame after the grid, which would otherwise cover its edges.
    let _ = writeln!(
        svg,
        r##"<rect x="{:.1}" y="{:.1}" width="{iw:.1}" height="{ih:.1}" fill="none" stroke="#444"/>"##,
        x0 + pl,
        y0 + pt
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{xlabel}</text>"#,
        x0 + pl + iw / 2.0,
        y0 + h - 8.0
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle" transform="rotate(-90 {:.1} {:.1})">{ylabel}</text>"#,
        x0 + 16.0,
        y0 + pt + ih / 2.0,
        x0 + 16.0,
        y0 + pt + ih / 2.0
    );
    for (i, s) in series.iter().enumerate() {
        let path: Vec<String> = s
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let dash = if s.dashed {
            r#" stroke-dasharray="5,4""#
        } else {
            ""
        };
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"{dash}/>"#,
            path.join(" "),
            s.color
        );
        for &(x, y) in &s.points {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{}"/>"#,
                sx(x),
                sy(y),
                s.color
            );
        }
        let ly = y0 + pt + 14.0 + i as f64 * 15.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}" font-size="11">{}</text>"#,
            x0 + pl + 8.0,
            x0 + pl + 28.0,
            s.color,
            x0 + pl + 33.0,
            ly + 4.0,
            s.name
        );
    }
}

/// The x value of a point and the axis label.
fn x_of(sweep: &Sweep, r: &RunResult) -> f64 {
    match sweep.variable {
        SweepVariable::Workers => r.workers as f64,
        SweepVariable::Chunk => f64::from(r.chunk_bytes),
        SweepVariable::Lcores => r.lcores as f64,
        SweepVariable::Window => r.window as f64,
        SweepVariable::Model => r.model_bytes as f64 / 1e6,
    }
}

fn x_label(sweep: &Sweep) -> &'static str {
    match sweep.variable {
        SweepVariable::Workers => "workers W",
        SweepVariable::Chunk => "chunk payload (bytes)",
        SweepVariable::Lcores => "dataplane lcores L",
        SweepVariable::Window => "worker window (chunks)",
        SweepVariable::Model => "model size (MB per worker per round)",
    }
}

/// An SVG document's opening: its size, sans-serif text, a white ground.
fn open_svg(w: f64, h: f64) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    s
}

/// The SVG text of the plot.
pub fn svg(sweep: &Sweep, points: &[RunResult]) -> String {
    let (w, h) = (1000.0, 420.0);
    let mut s = open_svg(w, h);
    let first = points.first();
    let caption = first.map_or(String::new(), |r| {
        format!(
            "phub-bench run: {} W={} L={} chunk={} B, backend {} (median of {} rounds; p99 dashed)",
            if sweep.variable == SweepVariable::Model {
                "models"
            } else {
                &r.model
            },
            if sweep.variable == SweepVariable::Workers {
                "*".into()
            } else {
                r.workers.to_string()
            },
            if sweep.variable == SweepVariable::Lcores {
                "*".into()
            } else {
                r.lcores.to_string()
            },
            if sweep.variable == SweepVariable::Chunk {
                "*".into()
            } else {
                r.chunk_bytes.to_string()
            },
            r.backend,
            r.rounds
        )
    });
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle" fill="#333">{caption}</text>"##,
        w / 2.0,
        h - 4.0
    );
    let pts = |f: &dyn Fn(&RunResult) -> Option<f64>| -> Vec<(f64, f64)> {
        points
            .iter()
            .filter_map(|r| f(r).filter(|v| v.is_finite()).map(|v| (x_of(sweep, r), v)))
            .collect()
    };
    let mut left = vec![
        Series {
            name: "phub median",
            color: "#1f77b4",
            dashed: false,
            points: pts(&|r| Some(r.round_ms_median)),
        },
        Series {
            name: "phub p99",
            color: "#1f77b4",
            dashed: true,
            points: pts(&|r| Some(r.round_ms_p99)),
        },
    ];
    let bound = pts(&|r| r.bound_round_ms);
    if !bound.is_empty() {
        left.push(Series {
            name: "UDP echo ceiling (same run)",
            color: "#2ca02c",
            dashed: false,
            points: bound,
        });
    }
    let tcp = pts(&|r| r.ceilings.as_ref().map(|c| c.tcp_echo_round_ms));
    if !tcp.is_empty() {
        left.push(Series {
            name: "TCP echo (same run)",
            color: "#ff7f0e",
            dashed: true,
            points: tcp,
        });
    }
    panel(
        &mut s,
        0.0,
        0.0,
        w / 2.0,
        h - 20.0,
        "round time",
        x_label(sweep),
        "ms per round",
        &left,
    );
    let mut right = vec![Series {
        name: "goodput per worker",
        color: "#1f77b4",
        dashed: false,
        points: pts(&|r| Some(r.goodput_gbps)),
    }];
    let inb = pts(&|r| r.appliance_gbps_in);
    if !inb.is_empty() {
        right.push(Series {
            name: "appliance in",
            color: "#9467bd",
            dashed: true,
            points: inb,
        });
    }
    panel(
        &mut s,
        w / 2.0,
        0.0,
        w / 2.0,
        h - 20.0,
        "throughput",
        x_label(sweep),
        "GB/s",
        &right,
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(feature = "png")]
use super::png::{fonts_for_png, png};

/// What a `.png` name gets from a build without the `png` feature.
#[cfg(not(feature = "png"))]
fn no_png() -> anyhow::Error {
    anyhow!(
        "this phub-bench writes no PNG: it was built without phub-tools' `png` feature (cargo build \
         --release -p phub-tools --features png); ask for .svg"
    )
}

#[cfg(not(feature = "png"))]
fn fonts_for_png() -> Result<()> {
    Err(no_png())
}

#[cfg(not(feature = "png"))]
fn png(_svg: &str) -> Result<Vec<u8>> {
    Err(no_png())
}

/// Whether `path` names a PNG (else an SVG); fails on any other name.
fn is_png(path: &Path) -> Result<bool> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    match ext.as_str() {
        "svg" => Ok(false),
        "png" => Ok(true),
        _ => bail!("--plot {}: expected a .svg or .png file name", path.display()),
    }
}

/// Checks, before any run, that the plot can be written to `path`: a
/// `.svg` or `.png` name, and for a PNG a font for its labels.
pub fn check(path: &Path) -> Result<()> {
    if is_png(path)? {
        fonts_for_png().with_context(|| format!("--plot {}", path.display()))?;
    }
    Ok(())
}

/// Writes the plot to `path`: `.svg`, or `.png` rendered from it.
pub fn write(path: &Path, sweep: &Sweep, points: &[RunResult]) -> Result<()> {
    write_text(path, svg(sweep, points))
}

/// Writes an SVG document to `path`: as it is, or rendered as a PNG for a
/// `.png` name (with the `png` feature).
pub fn write_text(path: &Path, text: String) -> Result<()> {
    let bytes = if is_png(path)? {
        png(&text).with_context(|| format!("--plot {}", path.display()))?
    } else {
        text.into_bytes()
    };
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// Line colours, in the order [`panels_svg`]'s callers use them.
pub const COLORS: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
    "#17becf",
];

/// A line of a [`Panel`].
pub struct Line {
    /// Legend text.
    pub name: String,
    /// Stroke colour (e.g. one of [`COLORS`]).
    pub color: &'static str,
    /// Dashed rather than solid.
    pub dashed: bool,
    /// (x, y) points, in drawing order.
    pub points: Vec<(f64, f64)>,
}

/// One panel of [`panels_svg`]: y from 0, axes fitted to the lines.
pub struct Panel {
    /// Title above it.
    pub title: String,
    /// x axis label.
    pub xlabel: String,
    /// y axis label.
    pub ylabel: String,
    /// Its lines.
    pub lines: Vec<Line>,
}

/// Panels side by side, 500 px wide each, in the sweep plot's style, with
/// `caption` under them (e.g. `phub-demo converge`'s figure).
pub fn panels_svg(panels: &[Panel], caption: &str) -> String {
    let (pw, h) = (500.0, 420.0);
    let w = pw * panels.len().max(1) as f64;
    let mut s = open_svg(w, h);
    for (i, p) in panels.iter().enumerate() {
        let series: Vec<Series<'_>> = p
            .lines
            .iter()
            .map(|l| Series {
                name: &l.name,
                color: l.color,
                dashed: l.dashed,
                points: l.points.clone(),
            })
            .collect();
        panel(
            &mut s,
            pw * i as f64,
            0.0,
            pw,
            h - 20.0,
            &p.title,
            &p.xlabel,
            &p.ylabel,
            &series,
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle" fill="#333">{caption}</text>"##,
        w / 2.0,
        h - 4.0
    );
    s.push_str("</svg>\n");
    s
}

/// A one-panel plot, 400x300: title, axis labels, ticks, a legend (for
/// the PNG's tests).
#[cfg(all(test, feature = "png"))]
pub(super) fn small_plot() -> String {
    let mut s = open_svg(400.0, 300.0);
    let series = [Series {
        name: "phub median",
        color: "#1f77b4",
        dashed: false,
        points: vec![(1.0, 10.0), (2.0, 14.0), (4.0, 25.0)],
    }];
    panel(
        &mut s,
        0.0,
        0.0,
        400.0,
        300.0,
        "round time",
        "workers W",
        "ms per round",
        &series,
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_have_their_lines_and_caption() {
        let p = Panel {
            title: "time to target".into(),
            xlabel: "τ".into(),
            ylabel: "s".into(),
            lines: vec![Line {
                name: "bounded delay".into(),
                color: COLORS[0],
                dashed: false,
                points: vec![(0.0, 3.0), (4.0, 2.0), (16.0, 2.5)],
            }],
        };
        let svg = panels_svg(&[p], "W = 4");
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{svg}"
        );
        assert!(svg.contains(">time to target</text>") && svg.contains(">W = 4</text>"));
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert_eq!(svg.matches("<circle").count(), 3);
    }

    /// Without the `png` feature a `.png` name fails before any run,
    /// saying how to build one that writes it; `.svg` needs nothing.
    #[cfg(not(feature = "png"))]
    #[test]
    fn a_png_without_the_feature_says_how_to_get_one() {
        let e = format!("{:#}", check(Path::new("f.png")).unwrap_err());
        assert!(e.contains("--features png") && e.contains(".svg"), "{e}");
        check(Path::new("f.svg")).unwrap();
        assert!(check(Path::new("f.jpg")).is_err());
    }

    #[test]
    fn ticks_are_nice_and_cover() {
        assert_eq!(ticks(0.0, 10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(1.0, 8.0);
        assert!(t[0] <= 1.0 && *t.last().unwrap() >= 8.0 - 1e-9);
        assert!(ticks(0.0, 0.37).len() <= 7);
    }
}
