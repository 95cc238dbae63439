//! Repeated measurements and the results table.

use std::fmt::Write as _;

/// Several runs of one measurement.
#[derive(Debug, Clone, Default)]
pub struct Samples {
    pub values: Vec<f64>,
}

impl Samples {
    pub fn push(&mut self, value: f64) {
        self.values.push(value);
    }

    fn sorted(&self) -> Vec<f64> {
        let mut values = self.values.clone();
        values.sort_by(f64::total_cmp);
        values
    }

    pub fn min(&self) -> f64 {
        self.sorted().first().copied().unwrap_or(f64::NAN)
    }

    pub fn max(&self) -> f64 {
        self.sorted().last().copied().unwrap_or(f64::NAN)
    }

    /// The middle value (the mean of the two middle ones for an even count).
    pub fn median(&self) -> f64 {
        let values = self.sorted();
        match values.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => values[n / 2],
            n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
        }
    }
}

/// Whether a row meets its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Met,
    Missed,
    /// No target: a reference figure.
    Info,
}

#[derive(Debug, Clone)]
pub struct Row {
    pub measure: String,
    pub unit: String,
    pub samples: Samples,
    pub target: String,
    pub verdict: Verdict,
    pub note: String,
}

/// Rows in the order they were measured.
#[derive(Debug, Default)]
pub struct Table {
    pub rows: Vec<Row>,
}

/// `higher` says whether bigger is better, for the verdict on the median.
pub struct Target {
    pub text: &'static str,
    pub bound: f64,
    pub higher: bool,
}

impl Table {
    pub fn add(
        &mut self,
        measure: impl Into<String>,
        unit: &str,
        samples: Samples,
        target: Option<Target>,
        note: impl Into<String>,
    ) {
        let (target, verdict) = match target {
            None => (String::new(), Verdict::Info),
            Some(t) => {
                let median = samples.median();
                let met = if t.higher {
                    median >= t.bound
                } else {
                    median <= t.bound
                };
                (
                    t.text.to_owned(),
                    if met { Verdict::Met } else { Verdict::Missed },
                )
            }
        };
        let row = Row {
            measure: measure.into(),
            unit: unit.to_owned(),
            samples,
            target,
            verdict,
            note: note.into(),
        };
        println!("bench: {}", render_row(&row));
        self.rows.push(row);
    }

    pub fn markdown(&self) -> String {
        let mut out = String::new();
        out.push_str("| measure | unit | runs | min | median | max | target | met | note |\n");
        out.push_str("|---|---|---|---|---|---|---|---|---|\n");
        for row in &self.rows {
            let _ = writeln!(out, "| {} |", render_row(row));
        }
        out
    }
}

fn render_row(row: &Row) -> String {
    let met = match row.verdict {
        Verdict::Met => "yes",
        Verdict::Missed => "**no**",
        Verdict::Info => "",
    };
    format!(
        "{} | {} | {} | {} | {} | {} | {} | {} | {}",
        row.measure,
        row.unit,
        row.samples.values.len(),
        number(row.samples.min()),
        number(row.samples.median()),
        number(row.samples.max()),
        row.target,
        met,
        row.note
    )
}

/// Thousands separators for big numbers, two decimals for small ones.
pub fn number(value: f64) -> String {
    if value.is_nan() {
        return "n/a".into();
    }
    if value.abs() >= 1000.0 {
        let rounded = value.round() as i64;
        let digits = rounded.unsigned_abs().to_string();
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i).is_multiple_of(3) {
                out.push(',');
            }
            out.push(c);
        }
        if rounded < 0 {
            out.insert(0, '-');
        }
        out
    } else if value.abs() >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        let s = Samples {
            values: vec![3.0, 1.0, 2.0],
        };
        assert_eq!((s.min(), s.median(), s.max()), (1.0, 2.0, 3.0));
        let s = Samples {
            values: vec![4.0, 1.0, 2.0, 3.0],
        };
        assert_eq!(s.median(), 2.5);
    }

    #[test]
    fn numbers_are_readable() {
        assert_eq!(number(1_234_567.4), "1,234,567");
        assert_eq!(number(-1234.0), "-1,234");
        assert_eq!(number(12.345), "12.3");
        assert_eq!(number(0.5), "0.50");
        assert_eq!(number(f64::NAN), "n/a");
    }

    #[test]
    fn verdict_follows_the_median_and_direction() {
        let mut table = Table::default();
        let s = Samples {
            values: vec![1.0, 5.0, 9.0],
        };
        table.add(
            "a",
            "x",
            s.clone(),
            Some(Target {
                text: ">= 4",
                bound: 4.0,
                higher: true,
            }),
            "",
        );
        table.add(
            "b",
            "x",
            s,
            Some(Target {
                text: "<= 4",
                bound: 4.0,
                higher: false,
            }),
            "",
        );
        assert_eq!(table.rows[0].verdict, Verdict::Met);
        assert_eq!(table.rows[1].verdict, Verdict::Missed);
        assert!(table.markdown().contains("**no**"));
    }
}
