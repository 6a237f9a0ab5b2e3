//! Charts for benchmark results (SVG, plotters).

use std::path::Path;

use anyhow::anyhow;
use plotters::prelude::*;

use crate::seed::{PROFILES, Pair, summarize};

/// Each continuation's latency by profile, with the mean and its 95% interval.
pub fn seed_chart(path: &Path, pairs: &[Pair]) -> anyhow::Result<()> {
    let top = pairs.iter().map(|p| p.latency_ms).fold(100.0, f64::max) * 1.15;
    let root = SVGBackend::new(path, (720, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Continuation latency by routing profile (two replicas, 12 pairs each)",
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5f64..2.5f64, 0f64..top)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(3)
        .x_label_formatter(&|x| {
            PROFILES
                .get(x.round() as usize)
                .filter(|_| (x - x.round()).abs() < 0.01)
                .map_or(String::new(), |p| p.name.to_owned())
        })
        .y_desc("latency (ms)")
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
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
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// Hit rate and the oracle's, per profile, for one scenario.
pub fn scenario_chart(path: &Path, title: &str, rows: &[(String, f64, f64)]) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (720, 400)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let n = rows.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5f64..(n - 0.5), 0f64..105f64)
        .map_err(|e| anyhow!("{e}"))?;
    let names: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(rows.len())
        .x_label_formatter(&|x| {
            names
                .get(x.round() as usize)
                .filter(|_| (x - x.round()).abs() < 0.01)
                .cloned()
                .unwrap_or_default()
        })
        .y_desc("prompt tokens served from cache (%)")
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    let hit = Palette99::pick(2).to_rgba();
    let oracle = RGBColor(180, 180, 180);
    chart
        .draw_series(
            rows.iter().enumerate().map(|(i, r)| {
                Rectangle::new([(i as f64 - 0.35, 0.0), (i as f64, r.1)], hit.filled())
            }),
        )
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
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
