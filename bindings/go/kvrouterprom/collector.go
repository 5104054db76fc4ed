// Package kvrouterprom exposes kvrouter's metrics to a Prometheus client_golang registry.
//
// A Collector re-emits the Prometheus text that libkvrouter renders itself
// (Router.MetricsPrometheus, and an Ingest's when given one) as const metrics at every scrape,
// so the names, labels, help texts and types are exactly the library's, and metrics a newer
// libkvrouter adds appear without a change here:
//
//	reg := prometheus.NewRegistry()
//	reg.MustRegister(kvrouterprom.NewCollector(router, ingest))
//	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
//
// It is its own Go module (github.com/kvrouter/kvrouter/bindings/go/kvrouterprom), so that the
// core binding stays standard-library only: only programs that import this package depend on
// client_golang.
package kvrouterprom

import (
	"fmt"
	"math"
	"reflect"
	"sort"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Source is anything that renders metrics in the Prometheus text exposition format:
// *kvrouter.Router and *kvrouter.Ingest, or a TextFunc.
type Source interface {
	MetricsPrometheus() (string, error)
}

// TextFunc adapts a function to a Source.
type TextFunc func() (string, error)

// MetricsPrometheus calls f.
func (f TextFunc) MetricsPrometheus() (string, error) { return f() }

// Collector is a prometheus.Collector over kvrouter objects. It is unchecked (Describe sends
// nothing): the families follow the loaded library, and a labelled family has no samples
// until, e.g., a worker is registered. The registry still checks at every Gather that no two
// collectors emit the same series. Safe for concurrent use.
type Collector struct {
	sources []Source

	mu    sync.Mutex
	descs map[string]*prometheus.Desc // by family name, help and label names
}

// NewCollector collects the metrics of each non-nil source (a *kvrouter.Router, a
// *kvrouter.Ingest, ...), in order, at every scrape. The sources must render distinct metric
// families (a router's and an ingest's do); a closed one makes the scrape report its error.
func NewCollector(sources ...Source) *Collector {
	c := &Collector{descs: map[string]*prometheus.Desc{}}
	for _, s := range sources {
		if s != nil && !isNilPointer(s) {
			c.sources = append(c.sources, s)
		}
	}
	return c
}

// isNilPointer reports a typed nil such as a (*kvrouter.Ingest)(nil) passed as a Source.
func isNilPointer(s Source) bool {
	v := reflect.ValueOf(s)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// Describe sends nothing: an unchecked collector (see Collector).
func (c *Collector) Describe(chan<- *prometheus.Desc) {}

// errorDesc names the failing source in an invalid metric.
var errorDesc = prometheus.NewDesc("kvrouter_collector_error", "A kvrouter source failed to render its metrics.", nil, nil)

// Collect renders each source's text, parses it and sends every sample as a const metric.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range c.sources {
		text, err := s.MetricsPrometheus()
		if err != nil {
			ch <- prometheus.NewInvalidMetric(errorDesc, fmt.Errorf("kvrouterprom: %T: %w", s, err))
			continue
		}
		families, err := Parse(text)
		if err != nil {
			ch <- prometheus.NewInvalidMetric(errorDesc, fmt.Errorf("kvrouterprom: %T: %w", s, err))
			continue
		}
		for _, mf := range families {
			c.emit(ch, mf)
		}
	}
}

// Parse parses Prometheus text (the library's) into metric families sorted by name.
func Parse(text string) ([]*dto.MetricFamily, error) {
	parser := expfmt.NewTextParser(model.LegacyValidation)
	byName, err := parser.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(byName))
	for name := range byName {
		names = append(names, name)
	}
	sort.Strings(names)
	out := make([]*dto.MetricFamily, 0, len(names))
	for _, name := range names {
		out = append(out, byName[name])
	}
	return out, nil
}

func (c *Collector) desc(mf *dto.MetricFamily, labels []string) *prometheus.Desc {
	key := mf.GetName() + "\x00" + mf.GetHelp() + "\x00" + strings.Join(labels, "\x00")
	c.mu.Lock()
	defer c.mu.Unlock()
	d, ok := c.descs[key]
	if !ok {
		d = prometheus.NewDesc(mf.GetName(), mf.GetHelp(), labels, nil)
		c.descs[key] = d
	}
	return d
}

func (c *Collector) emit(ch chan<- prometheus.Metric, mf *dto.MetricFamily) {
	for _, m := range mf.GetMetric() {
		names := make([]string, len(m.GetLabel()))
		values := make([]string, len(m.GetLabel()))
		for i, l := range m.GetLabel() {
			names[i], values[i] = l.GetName(), l.GetValue()
		}
		d := c.desc(mf, names)
		var metric prometheus.Metric
		var err error
		switch mf.GetType() {
		case dto.MetricType_COUNTER:
			metric, err = prometheus.NewConstMetric(d, prometheus.CounterValue, m.GetCounter().GetValue(), values...)
		case dto.MetricType_GAUGE:
			metric, err = prometheus.NewConstMetric(d, prometheus.GaugeValue, m.GetGauge().GetValue(), values...)
		case dto.MetricType_HISTOGRAM:
			h := m.GetHistogram()
			buckets := make(map[float64]uint64, len(h.GetBucket()))
			for _, b := range h.GetBucket() {
				if !math.IsInf(b.GetUpperBound(), +1) { // +Inf is the count, added by the registry
					buckets[b.GetUpperBound()] = b.GetCumulativeCount()
				}
			}
			metric, err = prometheus.NewConstHistogram(d, h.GetSampleCount(), h.GetSampleSum(), buckets, values...)
		case dto.MetricType_SUMMARY:
			s := m.GetSummary()
			quantiles := make(map[float64]float64, len(s.GetQuantile()))
			for _, q := range s.GetQuantile() {
				quantiles[q.GetQuantile()] = q.GetValue()
			}
			metric, err = prometheus.NewConstSummary(d, s.GetSampleCount(), s.GetSampleSum(), quantiles, values...)
		default:
			metric, err = prometheus.NewConstMetric(d, prometheus.UntypedValue, m.GetUntyped().GetValue(), values...)
		}
		if err != nil {
			metric = prometheus.NewInvalidMetric(d, err)
		}
		ch <- metric
	}
}
