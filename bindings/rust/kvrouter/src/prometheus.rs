//! A collector for the `prometheus` crate (the `prometheus` feature): the
//! router's metrics, and an ingest's, as `MetricFamily` protos for a `prometheus::Registry`.
//!
//! ```
//! use std::sync::Arc;
//! use kvrouter::prometheus::RouterCollector;
//! use kvrouter::{Router, RouterOptions, WorkerConfig};
//! use prometheus::{Encoder, Registry, TextEncoder};
//!
//! let router = Arc::new(Router::new(&RouterOptions::with_block_size(16))?);
//! router.add_worker(&WorkerConfig::new(1))?;
//! let registry = Registry::new();
//! registry.register(Box::new(RouterCollector::new(router.clone())?)).unwrap();
//!
//! let mut text = Vec::new();
//! TextEncoder::new().encode(&registry.gather(), &mut text).unwrap();
//! let text = String::from_utf8(text).unwrap();
//! assert!(text.contains("kvrouter_workers 1\n"));
//! # Ok::<(), kvrouter::Error>(())
//! ```
//!
//! The families are the library's own, read from its Prometheus text
//! ([`RouterRef::metrics_prometheus`]) at every collection: the same names, help texts, types
//! and labels as a scrape of that text, and whatever a newer 0.2.x library adds without a
//! change here. Counter, gauge, histogram and summary families become `COUNTER`, `GAUGE`,
//! `HISTOGRAM` and `SUMMARY` protos (a histogram's `_bucket` / `_sum` / `_count` series, or a
//! summary's quantiles, `_sum` and `_count`, one metric per label set; the `+Inf` bucket is the
//! count, as the encoders write it); a family of any other type (none so far) is passed on as
//! gauges.
//!
//! Works with prometheus 0.13.4 and 0.14, with or without their `protobuf` feature.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use ::prometheus::core::{Collector, Desc};
use ::prometheus::proto;

use crate::error::{Code, Error, Result};
use crate::ingest::Ingest;
use crate::router::Router;
#[cfg(doc)]
use crate::router::RouterRef;

type Labels = Vec<(String, String)>;
type TextSource = Box<dyn Fn() -> Result<String> + Send + Sync>;

/// A `prometheus::core::Collector` of a router's metrics, and optionally an ingest's, from the
/// library's Prometheus text (see the [module documentation](self)).
///
/// Its descriptors name every family the text had when the collector was made, with the
/// collector's constant labels and no variable labels (those are the library's: `kind`,
/// `outcome`, `worker_id`, ...; per-source families gain series as sources come and go).
/// Two collectors in one registry need different constant labels
/// ([`with_const_label`](Self::with_const_label)), e.g. the prefill and decode routers of a
/// [`Disagg`](crate::Disagg).
pub struct RouterCollector {
    sources: Vec<TextSource>,
    const_labels: Vec<(String, String)>,
    descs: Vec<Desc>,
}

impl fmt::Debug for RouterCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouterCollector")
            .field("sources", &self.sources.len())
            .field("const_labels", &self.const_labels)
            .field("families", &self.descs.len())
            .finish()
    }
}

impl RouterCollector {
    /// Collects `router`'s metrics (`kvr_router_metrics_prometheus`).
    pub fn new(router: Arc<Router>) -> Result<RouterCollector> {
        RouterCollector::from_text(move || router.metrics_prometheus())
    }

    /// Collects what `text` returns at each collection: Prometheus text exposition format, as
    /// [`RouterRef::metrics_prometheus`] writes it. For routers the collector cannot own as an
    /// `Arc<Router>`, such as a [`Disagg`](crate::Disagg)'s:
    /// `RouterCollector::from_text(move || disagg.prefill_router().metrics_prometheus())`.
    pub fn from_text<F>(text: F) -> Result<RouterCollector>
    where
        F: Fn() -> Result<String> + Send + Sync + 'static,
    {
        let mut collector = RouterCollector {
            sources: Vec::new(),
            const_labels: Vec::new(),
            descs: Vec::new(),
        };
        collector.sources.push(Box::new(text));
        collector.describe()?;
        Ok(collector)
    }

    /// Also collects `ingest`'s counters, one series per source
    /// ([`Ingest::metrics_prometheus`]: `kvrouter_ingest_*`).
    pub fn with_ingest(self, ingest: Arc<Ingest<'static>>) -> Result<RouterCollector> {
        self.with_text(move || ingest.metrics_prometheus())
    }

    /// Also collects what `text` returns (as [`from_text`](Self::from_text)).
    pub fn with_text<F>(mut self, text: F) -> Result<RouterCollector>
    where
        F: Fn() -> Result<String> + Send + Sync + 'static,
    {
        self.sources.push(Box::new(text));
        self.describe()?;
        Ok(self)
    }

    /// Adds a label with a fixed value to every series (`router="prefill"`).
    /// `InvalidArgument` for a name that is not a valid label name, a label the library's text
    /// has at that time (`kind`, `worker_id`, ...), or a constant label already given.
    pub fn with_const_label(mut self, name: &str, value: &str) -> Result<RouterCollector> {
        if self.const_labels.iter().any(|(n, _)| n == name) {
            return Err(Error::new(
                Code::InvalidArgument,
                format!("constant label {name} given twice"),
            ));
        }
        self.const_labels
            .push((name.to_string(), value.to_string()));
        self.describe()?;
        Ok(self)
    }

    /// The families of the text as it is now, and their descriptors.
    fn describe(&mut self) -> Result<()> {
        let families = self.read()?;
        let const_labels: HashMap<String, String> = self.const_labels.iter().cloned().collect();
        let mut descs = Vec::with_capacity(families.len());
        for family in &families {
            if let Some(series) = family.series.first() {
                if let Some((name, _)) = series
                    .labels
                    .iter()
                    .find(|(n, _)| const_labels.contains_key(n))
                {
                    return Err(Error::new(
                        Code::InvalidArgument,
                        format!("constant label {name} is a label of {}", family.name),
                    ));
                }
            }
            let desc = Desc::new(
                family.name.clone(),
                family.help_or_name().to_string(),
                Vec::new(),
                const_labels.clone(),
            )
            .map_err(|e| Error::new(Code::InvalidArgument, e.to_string()))?;
            descs.push(desc);
        }
        self.descs = descs;
        Ok(())
    }

    /// Every source's text, parsed; a family in two texts is kept once.
    fn read(&self) -> Result<Vec<Family>> {
        let mut families = Vec::new();
        for source in &self.sources {
            let text = source()?;
            for family in parse(&text)? {
                if !families.iter().any(|f: &Family| f.name == family.name) {
                    families.push(family);
                }
            }
        }
        Ok(families)
    }
}

impl Collector for RouterCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    /// The families as they are now. A source whose text cannot be had or read (which the
    /// library never gives) contributes nothing: a collection cannot fail.
    fn collect(&self) -> Vec<proto::MetricFamily> {
        let mut out = Vec::new();
        for source in &self.sources {
            let Ok(families) = source().and_then(|text| parse(&text)) else {
                continue;
            };
            out.extend(families.iter().map(|f| f.to_proto(&self.const_labels)));
        }
        out
    }
}

/// A family of the text format: `# HELP`, `# TYPE` and its samples.
#[derive(Debug, Default)]
struct Family {
    name: String,
    help: String,
    kind: Kind,
    /// Samples in the text's order (for a histogram: its `_bucket`, `_sum` and `_count`).
    series: Vec<Sample>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
    Summary,
    /// untyped, ...
    #[default]
    Other,
}

#[derive(Debug)]
struct Sample {
    /// The sample's own name: the family's, or with `_bucket` / `_sum` / `_count`.
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

impl Family {
    /// Desc::new refuses an empty help text.
    fn help_or_name(&self) -> &str {
        if self.help.is_empty() {
            &self.name
        } else {
            &self.help
        }
    }

    fn to_proto(&self, const_labels: &[(String, String)]) -> proto::MetricFamily {
        let mut family = proto::MetricFamily::default();
        family.set_name(self.name.clone());
        family.set_help(self.help.clone());
        match self.kind {
            Kind::Histogram => {
                family.set_field_type(proto::MetricType::HISTOGRAM);
                for metric in self.histograms(const_labels) {
                    family.mut_metric().push(metric);
                }
            }
            Kind::Summary => {
                family.set_field_type(proto::MetricType::SUMMARY);
                for metric in self.summaries(const_labels) {
                    family.mut_metric().push(metric);
                }
            }
            Kind::Counter => {
                family.set_field_type(proto::MetricType::COUNTER);
                for sample in &self.series {
                    let mut counter = proto::Counter::default();
                    counter.set_value(sample.value);
                    let mut metric = metric(&sample.labels, const_labels);
                    metric.set_counter(counter);
                    family.mut_metric().push(metric);
                }
            }
            // A gauge, or a type the prometheus crate no longer models (untyped, a summary's
            // samples): a value that may go up and down is the closest.
            Kind::Gauge | Kind::Other => {
                family.set_field_type(proto::MetricType::GAUGE);
                for sample in &self.series {
                    let mut gauge = proto::Gauge::default();
                    gauge.set_value(sample.value);
                    let mut metric = metric(&sample.labels, const_labels);
                    metric.set_gauge(gauge);
                    family.mut_metric().push(metric);
                }
            }
        }
        family
    }

    /// A histogram's or a summary's samples per label set (without `key`: `le`, `quantile`),
    /// in the order the sets first appear.
    fn groups(&self, key: &str) -> Vec<Group> {
        let mut groups: Vec<Group> = Vec::new();
        for sample in &self.series {
            let labels: Labels = sample
                .labels
                .iter()
                .filter(|(n, _)| n != key)
                .cloned()
                .collect();
            let index = match groups.iter().position(|g| g.labels == labels) {
                Some(i) => i,
                None => {
                    groups.push(Group {
                        labels,
                        ..Default::default()
                    });
                    groups.len() - 1
                }
            };
            let group = &mut groups[index];
            match &sample.name[self.name.len()..] {
                "_sum" => group.sum = sample.value,
                "_count" => group.count = sample.value as u64,
                "_bucket" | "" => {
                    let point = sample.labels.iter().find(|(n, _)| n == key);
                    if let Some(Ok(at)) = point.map(|(_, v)| parse_value(v)) {
                        group.points.push((at, sample.value));
                    }
                }
                _ => {}
            }
        }
        groups
    }

    fn histograms(&self, const_labels: &[(String, String)]) -> Vec<proto::Metric> {
        self.groups("le")
            .into_iter()
            .map(|group| {
                let buckets: Vec<proto::Bucket> = group
                    .points
                    .iter()
                    // The +Inf bucket is the count, which the encoders write as that bucket.
                    .filter(|(bound, _)| bound.is_finite())
                    .map(|&(bound, count)| {
                        let mut bucket = proto::Bucket::default();
                        bucket.set_upper_bound(bound);
                        bucket.set_cumulative_count(count as u64);
                        bucket
                    })
                    .collect();
                let mut histogram = proto::Histogram::default();
                histogram.set_bucket(repeated(buckets));
                histogram.set_sample_sum(group.sum);
                histogram.set_sample_count(group.count);
                let mut metric = metric(&group.labels, const_labels);
                metric.set_histogram(histogram);
                metric
            })
            .collect()
    }

    fn summaries(&self, const_labels: &[(String, String)]) -> Vec<proto::Metric> {
        self.groups("quantile")
            .into_iter()
            .map(|group| {
                let quantiles: Vec<proto::Quantile> = group
                    .points
                    .iter()
                    .map(|&(at, value)| {
                        let mut quantile = proto::Quantile::default();
                        quantile.set_quantile(at);
                        quantile.set_value(value);
                        quantile
                    })
                    .collect();
                let mut summary = proto::Summary::default();
                summary.set_quantile(repeated(quantiles));
                summary.set_sample_sum(group.sum);
                summary.set_sample_count(group.count);
                let mut metric = metric(&group.labels, const_labels);
                metric.set_summary(summary);
                metric
            })
            .collect()
    }
}

/// A histogram's or summary's series of one label set.
#[derive(Default)]
struct Group {
    labels: Labels,
    /// (`le` or `quantile`, value)
    points: Vec<(f64, f64)>,
    sum: f64,
    count: u64,
}

/// A `Vec` as the proto setters take it: a `Vec` in the plain model and protobuf 3
/// (prometheus 0.14), a `protobuf::RepeatedField` in protobuf 2 (0.13 with `protobuf`).
#[allow(clippy::useless_conversion)]
fn repeated<T, R: From<Vec<T>>>(items: Vec<T>) -> R {
    R::from(items)
}

/// A metric with the sample's labels, then the constant labels.
fn metric(labels: &[(String, String)], const_labels: &[(String, String)]) -> proto::Metric {
    let pairs: Vec<proto::LabelPair> = labels
        .iter()
        .chain(const_labels)
        .map(|(name, value)| {
            let mut pair = proto::LabelPair::default();
            pair.set_name(name.clone());
            pair.set_value(value.clone());
            pair
        })
        .collect();
    let mut metric = proto::Metric::default();
    metric.set_label(repeated(pairs));
    metric
}

fn bad_text(line: &str, what: &str) -> Error {
    Error::new(
        Code::Internal,
        format!("Prometheus text: {what} in line {line:?}"),
    )
}

/// Parses Prometheus text exposition format 0.0.4 into families, in the text's order.
fn parse(text: &str) -> Result<Vec<Family>> {
    let mut families: Vec<Family> = Vec::new();
    let family_index = |families: &mut Vec<Family>, name: &str| -> usize {
        match families.iter().position(|f| f.name == name) {
            Some(i) => i,
            None => {
                families.push(Family {
                    name: name.to_string(),
                    ..Default::default()
                });
                families.len() - 1
            }
        }
    };
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            let mut words = comment.trim_start().splitn(3, ' ');
            match (words.next(), words.next(), words.next()) {
                (Some("HELP"), Some(name), help) => {
                    let i = family_index(&mut families, name);
                    families[i].help = unescape(help.unwrap_or(""), false);
                }
                (Some("TYPE"), Some(name), Some(kind)) => {
                    let i = family_index(&mut families, name);
                    families[i].kind = match kind.trim() {
                        "counter" => Kind::Counter,
                        "gauge" => Kind::Gauge,
                        "histogram" => Kind::Histogram,
                        "summary" => Kind::Summary,
                        _ => Kind::Other,
                    };
                }
                _ => {} // any other comment
            }
            continue;
        }
        let sample = parse_sample(line)?;
        // A histogram's or summary's series belong to the family they extend; anything else
        // is its own.
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|suffix| Some((sample.name.strip_suffix(suffix)?, *suffix)))
            .find(|(base, suffix)| {
                families.iter().any(|f| {
                    f.name == *base
                        && (f.kind == Kind::Histogram
                            || (f.kind == Kind::Summary && *suffix != "_bucket"))
                })
            })
            .map(|(base, _)| base)
            .unwrap_or(&sample.name)
            .to_string();
        let i = family_index(&mut families, &family);
        families[i].series.push(sample);
    }
    Ok(families)
}

/// `name{label="value",...} value [timestamp]`.
fn parse_sample(line: &str) -> Result<Sample> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .ok_or_else(|| bad_text(line, "no value"))?;
    let name = line[..name_end].to_string();
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(mut inner) = rest.strip_prefix('{') {
        loop {
            inner = inner.trim_start_matches([' ', ',']);
            if let Some(after) = inner.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = inner
                .find('=')
                .ok_or_else(|| bad_text(line, "a label without ="))?;
            let label = inner[..eq].trim().to_string();
            let quoted = inner[eq + 1..]
                .trim_start()
                .strip_prefix('"')
                .ok_or_else(|| bad_text(line, "an unquoted label value"))?;
            let (value, after) = split_quoted(quoted)
                .ok_or_else(|| bad_text(line, "an unterminated label value"))?;
            labels.push((label, unescape(value, true)));
            inner = after;
        }
    }
    let value = rest
        .split_whitespace()
        .next()
        .ok_or_else(|| bad_text(line, "no value"))?;
    let value = parse_value(value).map_err(|_| bad_text(line, "a value that is not a number"))?;
    Ok(Sample {
        name,
        labels,
        value,
    })
}

/// A label value up to its closing quote (escapes kept), and what follows the quote.
fn split_quoted(s: &str) -> Option<(&str, &str)> {
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some((&s[..i], &s[i + 1..])),
            _ => {}
        }
    }
    None
}

/// `\\` and `\n` (help texts); `\"` too in label values.
fn unescape(s: &str, label_value: bool) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('\\') => out.push('\\'),
            Some('"') if label_value => out.push('"'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

/// A sample value: a number, `+Inf`, `-Inf` or `NaN`.
fn parse_value(s: &str) -> std::result::Result<f64, std::num::ParseFloatError> {
    s.parse::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_format_is_parsed_into_families() {
        let text = "# HELP a_total Things, with a \\\\ and a\\nnew line.\n\
                    # TYPE a_total counter\n\
                    a_total{kind=\"x\",outcome=\"y \\\"z\\\"\"} 3\n\
                    a_total{kind=\"w\",outcome=\"v\",} 4 1700000000000\n\
                    # TYPE g gauge\n\
                    g -2.5\n\
                    # HELP h Latency.\n\
                    # TYPE h histogram\n\
                    h_bucket{le=\"256\"} 1\n\
                    h_bucket{le=\"512\"} 3\n\
                    h_bucket{le=\"+Inf\"} 4\n\
                    h_sum 2000\n\
                    h_count 4\n\
                    h_other 1\n\
                    loose 7\n\
                    # TYPE s summary\n\
                    s{src=\"a\",quantile=\"0.5\"} 2\n\
                    s_sum{src=\"a\"} 9\n\
                    s_count{src=\"a\"} 3\n\
                    s_sum{src=\"b\"} 1\n\
                    s_count{src=\"b\"} 1\n";
        let families = parse(text).unwrap();
        let names: Vec<&str> = families.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["a_total", "g", "h", "h_other", "loose", "s"]);
        let a = &families[0];
        assert_eq!(a.help, "Things, with a \\ and a\nnew line.");
        assert_eq!(a.kind, Kind::Counter);
        assert_eq!(a.series[0].labels[1], ("outcome".into(), "y \"z\"".into()));
        assert_eq!(a.series[1].value, 4.0);
        assert_eq!(families[1].series[0].value, -2.5);
        let h = &families[2];
        assert_eq!((h.kind, h.series.len()), (Kind::Histogram, 5));
        let groups = h.groups("le");
        assert_eq!(groups.len(), 1);
        let inf = f64::INFINITY;
        assert_eq!(groups[0].points, [(256.0, 1.0), (512.0, 3.0), (inf, 4.0)]);
        assert_eq!((groups[0].sum, groups[0].count), (2000.0, 4));
        let s = &families[5];
        assert_eq!((s.kind, s.series.len()), (Kind::Summary, 5));
        let groups = s.groups("quantile");
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].labels, [("src".to_string(), "a".to_string())]);
        assert_eq!(groups[0].points, [(0.5, 2.0)]);
        assert_eq!((groups[0].sum, groups[0].count), (9.0, 3));
        assert_eq!((groups[1].points.len(), groups[1].count), (0, 1));
        assert_eq!(families[4].kind, Kind::Other);
        for bad in ["novalue", "x{a=\"b} 1", "x{a=b} 1", "x{a} 1", "x one"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
