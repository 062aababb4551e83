//! `--plot F.png`: the plot's SVG rendered with `resvg` (pure Rust) at
//! twice its size, its text set in a system sans-serif font (DejaVu Sans
//! from Debian's `fonts-dejavu-core`, or another of [`SANS_FAMILIES`]);
//! without one it fails and says what to install rather than writing a
//! PNG without labels. Built with phub-tools' `png` feature only (its
//! font and raster crates are about a minute of a 2-core build, which
//! `make test` does without).

use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use resvg::tiny_skia;
use resvg::usvg;
use resvg::usvg::fontdb;

/// Sans-serif families a PNG's text may be set in, in order of preference.
pub(super) const SANS_FAMILIES: &[&str] = &[
    "DejaVu Sans",
    "Liberation Sans",
    "Noto Sans",
    "FreeSans",
    "Arial",
    "Helvetica",
];

/// A PNG is rendered at this multiple of the SVG's size (sharp text).
const PNG_SCALE: f32 = 2.0;

/// The system's fonts, with the generic `sans-serif` (and, as usvg's
/// fallback, `serif`) mapped to the first of [`SANS_FAMILIES`] installed.
fn fonts() -> Result<fontdb::Database> {
    let mut db = fontdb::Database::new();
    db.load_system_fonts();
    pick_sans(&mut db)?;
    Ok(db)
}

/// Maps `sans-serif` and `serif` in `db` to the first of [`SANS_FAMILIES`]
/// it holds; fails, naming the package to install, if it holds none.
fn pick_sans(db: &mut fontdb::Database) -> Result<()> {
    let family = SANS_FAMILIES
        .iter()
        .find(|f| db.faces().any(|face| face.families.iter().any(|(n, _)| n == *f)))
        .ok_or_else(|| {
            anyhow!(
                "no sans-serif font for the PNG's labels: none of {} among the {} font faces found \
                 (fontconfig's directories, /usr/share/fonts); install Debian's `fonts-dejavu-core` \
                 (tools/setup.sh does), or ask for .svg",
                SANS_FAMILIES.join(", "),
                db.len()
            )
        })?;
    db.set_sans_serif_family(*family);
    db.set_serif_family(*family);
    Ok(())
}

/// `<text>` elements of `svg` that have content (usvg drops empty ones).
fn texts_with_content(svg: &str) -> usize {
    svg.split("<text")
        .skip(1)
        .filter(|rest| {
            rest.split_once('>')
                .is_some_and(|(_, after)| !after.starts_with('<'))
        })
        .count()
}

/// Text nodes usvg laid out (it drops a text it has no font for).
fn laid_out_texts(g: &usvg::Group) -> usize {
    g.children()
        .iter()
        .map(|n| match n {
            usvg::Node::Text(_) => 1,
            usvg::Node::Group(g) => laid_out_texts(g),
            _ => 0,
        })
        .sum()
}

/// Renders `svg` to PNG bytes at [`PNG_SCALE`] times its size, with the
/// system's fonts; fails if a label could not be set.
pub(super) fn png(svg: &str) -> Result<Vec<u8>> {
    let opt = usvg::Options {
        fontdb: Arc::new(fonts()?),
        ..usvg::Options::default()
    };
    let tree = usvg::Tree::from_str(svg, &opt).context("parsing the plot's SVG")?;
    let (want, got) = (texts_with_content(svg), laid_out_texts(tree.root()));
    if got != want {
        bail!("only {got} of the plot's {want} labels could be set in a font; ask for .svg");
    }
    let size = tree
        .size()
        .to_int_size()
        .scale_by(PNG_SCALE)
        .ok_or_else(|| anyhow!("plot size {:?} times {PNG_SCALE} is not a PNG size", tree.size()))?;
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height())
        .ok_or_else(|| anyhow!("cannot allocate a {}x{} image", size.width(), size.height()))?;
    pixmap.fill(tiny_skia::Color::WHITE);
    resvg::render(
        &tree,
        tiny_skia::Transform::from_scale(PNG_SCALE, PNG_SCALE),
        &mut pixmap.as_mut(),
    );
    pixmap.encode_png().context("encoding the PNG")
}

/// Whether a font for a PNG's labels is installed (checked before the
/// runs: a missing one fails then, not after them).
pub(super) fn fonts_for_png() -> Result<()> {
    fonts().map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::plot::small_plot;

    #[test]
    fn png_has_its_size_axes_and_labels() {
        let svg = small_plot();
        let png = png(&svg).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
        // IHDR, the first chunk: width and height, big-endian.
        assert_eq!(&png[12..16], b"IHDR");
        let wh = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
        assert_eq!((wh(16), wh(20)), (800, 600), "twice the SVG's 400x300");
        let img = tiny_skia::Pixmap::decode_png(&png).unwrap();
        let dark = |x: u32, y: u32| {
            let p = img.pixel(x, y).unwrap();
            p.red() < 0x80 && p.green() < 0x80 && p.blue() < 0x80
        };
        let dark_in = |x0: u32, y0: u32, x1: u32, y1: u32| {
            (y0..y1)
                .flat_map(|y| (x0..x1).map(move |x| (x, y)))
                .filter(|&(x, y)| dark(x, y))
                .count()
        };
        // The frame (#444, 1 px wide, so 2 px here): its left edge at
        // x = 60 in the SVG covers pixel columns 119 and 120, its bottom
        // edge at y = 300 - 45 pixel rows 509 and 510. The data start on
        // the left edge at y = 165 (row 330), so look above that.
        assert!((70..300).all(|y| dark(119, y) && dark(120, y)), "left axis drawn");
        assert!(
            (200..700).all(|x| dark(x, 509) && dark(x, 510)),
            "bottom axis drawn"
        );
        // Nothing but text lies above the frame (the title) or left of the
        // tick labels (the rotated y label): dark pixels there are glyphs.
        assert!(dark_in(200, 0, 700, 55) > 100, "title set");
        assert!(dark_in(0, 100, 45, 500) > 100, "y-axis label set");
        assert!(dark_in(0, 0, 800, 600) < 800 * 600 / 4, "mostly white");
    }

    #[test]
    fn labels_without_content_are_not_counted() {
        assert_eq!(
            texts_with_content(r#"<text x="1"></text><text y="2">a</text><line/>"#),
            1
        );
        let svg = small_plot();
        assert_eq!(texts_with_content(&svg), svg.matches("<text").count());
    }

    #[test]
    fn no_font_names_the_package_to_install() {
        let mut db = fontdb::Database::new();
        let e = pick_sans(&mut db).unwrap_err().to_string();
        assert!(
            e.contains("fonts-dejavu-core") && e.contains("DejaVu Sans"),
            "{e}"
        );
    }
}
