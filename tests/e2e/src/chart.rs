//! Charts for benchmark results (SVG, plotters).

use std::path::Path;

use anyhow::anyhow;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::seed::{PROFILES, Pair, summarize};

/// Each continuation's latency by profile, with the mean and its 95% interval.
pub fn seed_chart(path: &Path, pairs: &[Pair]) -> anyhow::Result<()> {
    let top = pairs.iter().map(|p| p.latency_ms).fold(100.0, f64::max) * 1.15;
    let names: Vec<String> = PROFILES.iter().map(|p| p.name.to_owned()).collect();
    let title = "Continuation latency by routing profile (two replicas, 12 pairs each)";
    categories(
        path,
        (720, 440),
        title,
        &names,
        top,
        "latency (ms)",
        |chart| {
            for (i, profile) in PROFILES.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                let points: Vec<(f64, f64)> = pairs
                    .iter()
                    .filter(|p| p.profile == profile.name)
                    .map(|p| {
                        (
                            i as f64 - 0.25 + 0.5 * (p.index as f64 / 12.0),
                            p.latency_ms,
                        )
                    })
                    .collect();
                chart
                    .draw_series(
                        points
                            .iter()
                            .map(|&(x, y)| Circle::new((x, y), 4, color.filled())),
                    )
                    .map_err(|e| anyhow!("{e}"))?
                    .label(profile.name)
                    .legend(move |(x, y)| Circle::new((x, y), 4, color.filled()));
                let s = summarize(pairs, profile.name);
                chart
                    .draw_series(std::iter::once(ErrorBar::new_vertical(
                        i as f64 + 0.32,
                        s.mean_latency_ms - s.ci95_ms,
                        s.mean_latency_ms,
                        s.mean_latency_ms + s.ci95_ms,
                        BLACK.stroke_width(2),
                        10,
                    )))
                    .map_err(|e| anyhow!("{e}"))?;
            }
            Ok(())
        },
    )
}

/// Hit rate and the oracle's, per profile, for one scenario.
pub fn scenario_chart(path: &Path, title: &str, rows: &[(String, f64, f64)]) -> anyhow::Result<()> {
    let names: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
    let y_desc = "prompt tokens served from cache (%)";
    categories(path, (720, 400), title, &names, 105.0, y_desc, |chart| {
        let hit = Palette99::pick(2).to_rgba();
        let oracle = RGBColor(180, 180, 180);
        chart
            .draw_series(rows.iter().enumerate().map(|(i, r)| {
                Rectangle::new([(i as f64 - 0.35, 0.0), (i as f64, r.1)], hit.filled())
            }))
            .map_err(|e| anyhow!("{e}"))?
            .label("kv hit")
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], hit.filled()));
        chart
            .draw_series(rows.iter().enumerate().map(|(i, r)| {
                Rectangle::new([(i as f64, 0.0), (i as f64 + 0.35, r.2)], oracle.filled())
            }))
            .map_err(|e| anyhow!("{e}"))?
            .label("oracle")
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], oracle.filled()));
        Ok(())
    })
}

/// The chart area both charts draw on.
type Area<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// An SVG chart with one column per name (x = 0, 1, ...) and values up to `top`: frame,
/// labels and legend around what `draw` puts in it.
fn categories(
    path: &Path,
    size: (u32, u32),
    title: &str,
    names: &[String],
    top: f64,
    y_desc: &str,
    draw: impl FnOnce(&mut Area<'_, '_>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let n = names.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5f64..(n - 0.5), 0f64..top)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(names.len())
        .x_label_formatter(&|x| {
            names
                .get(x.round() as usize)
                .filter(|_| (x - x.round()).abs() < 0.01)
                .cloned()
                .unwrap_or_default()
        })
        .y_desc(y_desc)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    draw(&mut chart)?;
    finish(root, &mut chart, SeriesLabelPosition::UpperRight)
}

/// Draws the legend at `position` and writes the file.
fn finish<'a, 'b: 'a>(
    root: DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    chart: &mut Area<'a, 'b>,
    position: SeriesLabelPosition,
) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// Lines over a shared x axis (one per named series, values up to 100), with a legend.
pub fn lines(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (900, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let right = series
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.0))
        .fold(0.0f64, f64::max)
        .max(1.0);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..right, 0f64..110f64)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (i, (name, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| anyhow!("{e}"))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    finish(root, &mut chart, SeriesLabelPosition::LowerRight)
}
