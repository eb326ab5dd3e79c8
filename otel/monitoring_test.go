package idempotencyotel_test

import (
	"context"
	"encoding/json"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
	"go.yaml.in/yaml/v3"

	"github.com/idempotency-go/idempotency"
	idempotencyotel "github.com/idempotency-go/idempotency/otel"
)

// The files that ship for operators, from this module's directory.
const (
	alertsFile     = "../monitoring/alerts.yml"
	dashboardFile  = "../monitoring/dashboard.json"
	operationsFile = "../docs/operations.md"
)

// family is a metric family as the Prometheus exporter serves it: its type
// and every label name of its samples (le for a histogram's buckets).
type family struct {
	typ    dto.MetricType
	labels map[string]bool
}

// targetLabels are the labels Prometheus adds to every series it scrapes.
var targetLabels = map[string]bool{"job": true, "instance": true}

// servedFamilies runs the Observer into OpenTelemetry's Prometheus exporter,
// configured as examples/payments has it (its defaults, on a registry of
// its own), drives Guards through calls of every kind the metrics report
// (runCalls and runFailures: outcomes of many kinds, a store call that
// failed, a wait, renewals, a takeover, sweeps), tracks a Guard and a store
// holding records in flight and abandoned, and returns what a scrape gets.
func servedFamilies(t *testing.T) map[string]family {
	t.Helper()
	reg := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(reg))
	require.NoError(t, err)
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	obs, err := idempotencyotel.NewObserver(idempotencyotel.Options{MeterProvider: mp,
		TracerProvider: tracenoop.NewTracerProvider()})
	require.NoError(t, err)

	ctx := context.Background()
	runCalls(t, ctx, obs)
	runFailures(t, ctx, obs)

	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	claimDead(t, ctx, store, idempotency.Key{Scope: scope, Name: "key-abandoned-19ce"})
	_, err = store.Claim(ctx, idempotency.ClaimRequest{Key: idempotency.Key{Scope: scope, Name: "key-live-5b04"},
		Fingerprint: fp, OperationID: "op-live", Lease: time.Hour, Retention: time.Hour})
	require.NoError(t, err)
	defer obs.TrackStore(store)()
	defer obs.Track(idempotency.New(store, idempotency.Options{Observer: obs}))()

	mfs, err := reg.Gather()
	require.NoError(t, err)
	served := map[string]family{}
	for _, mf := range mfs {
		f := family{typ: mf.GetType(), labels: map[string]bool{}}
		if f.typ == dto.MetricType_HISTOGRAM {
			f.labels["le"] = true
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				f.labels[l.GetName()] = true
			}
		}
		served[mf.GetName()] = f
	}
	return served
}

var (
	// quoted is a PromQL string: label values, whose text is not checked.
	quoted = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)
	// selector is the label matchers of a vector selector, grouping the
	// labels of an aggregation, matcherLabel one matcher's label name.
	selector     = regexp.MustCompile(`\{([^{}]*)\}`)
	grouping     = regexp.MustCompile(`\b(?:by|without)\s*\(([^()]*)\)`)
	matcherLabel = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)`)
	// metricName is a name of this library's metrics, outside selectors.
	metricName = regexp.MustCompile(`\bidempotency_[a-z0-9_]+\b`)
	// legendLabel is a label a Grafana legend shows.
	legendLabel = regexp.MustCompile(`\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}`)
)

// checkExpr fails t for each metric name in the PromQL expression expr
// that no family served has, and for each label it selects or groups by
// (or that legend shows) that none of its metrics have. It returns the
// families expr reads, a histogram's _bucket, _sum and _count series
// counting as the histogram.
func checkExpr(t *testing.T, served map[string]family, where, expr, legend string) []string {
	t.Helper()
	e := quoted.ReplaceAllString(expr, `""`)
	var labels []string
	for _, m := range selector.FindAllStringSubmatch(e, -1) {
		for _, l := range matcherLabel.FindAllStringSubmatch(m[1], -1) {
			labels = append(labels, l[1])
		}
	}
	for _, m := range grouping.FindAllStringSubmatch(e, -1) {
		for l := range strings.SplitSeq(m[1], ",") {
			if l = strings.TrimSpace(l); l != "" {
				labels = append(labels, l)
			}
		}
	}
	for _, m := range legendLabel.FindAllStringSubmatch(legend, -1) {
		labels = append(labels, m[1])
	}
	e = grouping.ReplaceAllString(selector.ReplaceAllString(e, ""), "")

	var families []string
	for _, name := range metricName.FindAllString(e, -1) {
		f, ok := name, false
		if _, ok = served[name]; !ok {
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if base, cut := strings.CutSuffix(name, suffix); cut && served[base].typ == dto.MetricType_HISTOGRAM {
					f, ok = base, true
					break
				}
			}
		}
		if assert.True(t, ok, "%s: %s is not served (in %s)", where, name, expr) && !slices.Contains(families, f) {
			families = append(families, f)
		}
	}
	for _, l := range labels {
		ok := targetLabels[l]
		for _, f := range families {
			ok = ok || served[f].labels[l]
		}
		assert.True(t, ok, "%s: label %s is on none of %v (in %s %s)", where, l, families, expr, legend)
	}
	return families
}

// TestMonitoringFilesUseServedMetrics checks that the alerts and the
// dashboard in monitoring/ read only metrics and labels that the Observer
// serves through OpenTelemetry's Prometheus exporter, that every alert's
// runbook is a heading of docs/operations.md, and that the dashboard takes
// its data source from a variable.
func TestMonitoringFilesUseServedMetrics(t *testing.T) {
	served := servedFamilies(t)
	var names []string
	for name := range served {
		if strings.HasPrefix(name, "idempotency_") {
			names = append(names, name)
		}
	}
	t.Logf("served: %v", names)
	assert.ElementsMatch(t, []string{
		"idempotency_outcomes_total", "idempotency_call_duration_seconds", "idempotency_wait_duration_seconds",
		"idempotency_renewals_total", "idempotency_renewal_duration_seconds", "idempotency_takeovers_total",
		"idempotency_sweep_records_total", "idempotency_sweeps_total", "idempotency_operation_count",
		"idempotency_waiter_count", "idempotency_store_records",
	}, names, "the Observer's metrics as docs/operations.md names them")

	t.Run("alerts", func(t *testing.T) {
		raw, err := os.ReadFile(alertsFile)
		require.NoError(t, err)
		var rules struct {
			Groups []struct {
				Rules []struct {
					Alert       string
					Expr        string
					For         string
					Labels      map[string]string
					Annotations map[string]string
				}
			}
		}
		require.NoError(t, yaml.Unmarshal(raw, &rules))
		anchors := headingAnchors(t)
		var alerts int
		for _, g := range rules.Groups {
			for _, r := range g.Rules {
				alerts++
				assert.NotEmpty(t, checkExpr(t, served, r.Alert, r.Expr, ""), r.Alert)
				assert.NotEmpty(t, r.For, r.Alert)
				assert.NotEmpty(t, r.Labels["severity"], r.Alert)
				assert.NotEmpty(t, r.Annotations["summary"], r.Alert)
				assert.NotEmpty(t, r.Annotations["description"], r.Alert)
				doc, anchor, _ := strings.Cut(r.Annotations["runbook"], "#")
				assert.Equal(t, "docs/operations.md", doc, r.Alert)
				assert.Contains(t, anchors, anchor, "%s: runbook %q is no heading of %s", r.Alert, r.Annotations["runbook"], operationsFile)
			}
		}
		assert.Equal(t, 5, alerts)
	})

	t.Run("dashboard", func(t *testing.T) {
		raw, err := os.ReadFile(dashboardFile)
		require.NoError(t, err)
		var dash map[string]any
		require.NoError(t, json.Unmarshal(raw, &dash))
		var read []string
		var exprs, sources int
		var walk func(where string, v any)
		walk = func(where string, v any) {
			switch v := v.(type) {
			case map[string]any:
				if title, ok := v["title"].(string); ok {
					where = title
				}
				if ds, ok := v["datasource"]; ok {
					sources++
					assert.Equal(t, map[string]any{"type": "prometheus", "uid": "${datasource}"}, ds, "%s: datasource", where)
				}
				expr, ok := v["expr"].(string)
				if q, isQuery := v["query"].(map[string]any); isQuery {
					expr, ok = q["query"].(string)
				}
				if ok {
					exprs++
					legend, _ := v["legendFormat"].(string)
					for _, f := range checkExpr(t, served, where, expr, legend) {
						if !slices.Contains(read, f) {
							read = append(read, f)
						}
					}
				}
				for k, c := range v {
					if k != "datasource" {
						walk(where, c)
					}
				}
			case []any:
				for _, c := range v {
					walk(where, c)
				}
			}
		}
		walk("dashboard", dash)
		assert.GreaterOrEqual(t, exprs, 10)
		assert.GreaterOrEqual(t, sources, exprs)
		assert.Subset(t, read, []string{
			"idempotency_outcomes_total", "idempotency_call_duration_seconds", "idempotency_wait_duration_seconds",
			"idempotency_renewals_total", "idempotency_renewal_duration_seconds", "idempotency_operation_count",
			"idempotency_waiter_count", "idempotency_store_records",
		})

		var vars struct {
			Templating struct {
				List []struct{ Name, Type, Query any }
			}
		}
		require.NoError(t, json.Unmarshal(raw, &vars))
		assert.Contains(t, vars.Templating.List, struct{ Name, Type, Query any }{"datasource", "datasource", "prometheus"})
	})
}

// headingAnchors returns the anchors GitHub gives the headings of
// docs/operations.md.
func headingAnchors(t *testing.T) []string {
	t.Helper()
	raw, err := os.ReadFile(operationsFile)
	require.NoError(t, err)
	drop := regexp.MustCompile(`[^a-z0-9 _-]`)
	var anchors []string
	var code bool // in a fenced code block, where # starts no heading
	for line := range strings.SplitSeq(string(raw), "\n") {
		if strings.HasPrefix(line, "```") {
			code = !code
		}
		if h, ok := strings.CutPrefix(strings.TrimLeft(line, "#"), " "); ok && !code && strings.HasPrefix(line, "#") {
			anchors = append(anchors, strings.ReplaceAll(drop.ReplaceAllString(strings.ToLower(h), ""), " ", "-"))
		}
	}
	return anchors
}
