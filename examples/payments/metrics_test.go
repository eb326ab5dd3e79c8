package main

import (
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// scrape GETs /metrics, with no Idempotency-Key: the route is not guarded.
func scrape(t *testing.T, base string) string {
	t.Helper()
	r, err := send(http.MethodGet, base+"/metrics", "", nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, r.status, "GET /metrics: %s", r)
	require.True(t, strings.HasPrefix(r.header.Get("Content-Type"), "text/plain"), "Content-Type %q", r.header.Get("Content-Type"))
	return string(r.body)
}

// sampleLine is one sample of the Prometheus text format: the series name,
// its label pairs in braces, and the value.
var sampleLine = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\} (\S+)$`)

// samples returns the values of the samples in body named name whose
// labels include every `key="value"` pair of labels: the exporter adds
// otel_scope_* labels of its own. (Label values with commas are not split
// right; these have none.)
func samples(body, name string, labels ...string) []string {
	var found []string
	for line := range strings.SplitSeq(body, "\n") {
		m := sampleLine.FindStringSubmatch(line)
		if m == nil || m[1] != name {
			continue
		}
		pairs := strings.Split(m[2], ",")
		if !slices.ContainsFunc(labels, func(l string) bool { return !slices.Contains(pairs, l) }) {
			found = append(found, m[3])
		}
	}
	return found
}

// sample returns the value of the one sample that samples finds, failing
// the test when there is none or more than one.
func sample(t *testing.T, body, name string, labels ...string) float64 {
	t.Helper()
	found := samples(body, name, labels...)
	require.Len(t, found, 1, "samples of %s{%s} in:\n%s", name, strings.Join(labels, ","), body)
	v, err := strconv.ParseFloat(found[0], 64)
	require.NoError(t, err)
	return v
}

// GET /metrics exports, through the OpenTelemetry Prometheus exporter, the
// Guard's metrics from the idempotencyotel Observer (outcomes, durations,
// renewals, operations and waiters now) and the store's records in flight
// and abandoned from Stats, read on each scrape; the names are those the
// README's alerts use.
func TestMetrics(t *testing.T) {
	t.Parallel()
	rs := testserver.StartRedis(t)
	// The charge takes two leases, so the Guard renews it; a duplicate
	// waits 100ms for it, then gets 409.
	a := start(t, "-redis", rs.Addr, "-work", "2s", "-lease", "1s", "-wait", "100ms")

	orig := inBackground(func() (reply, error) { return postCharge(a.url, "metered", "acct_1", chargeBody) })
	awaitGatewayCharges(t, a.url, 1)
	busy := scrape(t, a.url)
	dup, err := postCharge(a.url, "metered", "acct_1", chargeBody)
	require.NoError(t, err)
	assert.Equal(t, idempotency.ProblemTypes+"in-flight", requireProblem(t, dup, http.StatusConflict))
	first := <-orig
	require.NoError(t, first.err)
	chargeOf(t, first.reply)
	replay, err := postCharge(a.url, "metered", "acct_1", chargeBody)
	require.NoError(t, err)
	requireReplayOf(t, first.reply, replay)

	t.Run("while the charge runs", func(t *testing.T) {
		assert.Equal(t, 1.0, sample(t, busy, "idempotency_store_records", `idempotency_record_state="in_flight"`))
		assert.Equal(t, 0.0, sample(t, busy, "idempotency_store_records", `idempotency_record_state="abandoned"`))
		assert.Equal(t, 1.0, sample(t, busy, "idempotency_operation_count"))
		assert.Equal(t, 0.0, sample(t, busy, "idempotency_waiter_count"))
	})

	body := scrape(t, a.url)
	t.Run("types", func(t *testing.T) {
		for _, typ := range []string{
			"idempotency_outcomes_total counter",
			"idempotency_call_duration_seconds histogram",
			"idempotency_wait_duration_seconds histogram",
			"idempotency_renewals_total counter",
			"idempotency_renewal_duration_seconds histogram",
			"idempotency_operation_count gauge",
			"idempotency_waiter_count gauge",
			"idempotency_store_records gauge",
		} {
			assert.Contains(t, body, "\n# TYPE "+typ+"\n")
		}
	})
	t.Run("outcomes", func(t *testing.T) {
		route := []string{`http_request_method="POST"`, `http_route="/v1/charges"`}
		for _, outcome := range []string{"executed", "replayed", "in_flight"} {
			labels := append([]string{`idempotency_outcome="` + outcome + `"`}, route...)
			assert.Equal(t, 1.0, sample(t, body, "idempotency_outcomes_total", labels...), outcome)
			assert.Equal(t, 1.0, sample(t, body, "idempotency_call_duration_seconds_count", labels...), outcome)
		}
		// The 409 is the library's error: error.type is its outcome.
		assert.Equal(t, 1.0, sample(t, body, "idempotency_outcomes_total",
			`idempotency_outcome="in_flight"`, `error_type="in_flight"`))
		assert.Equal(t, 1.0, sample(t, body, "idempotency_outcomes_total",
			`idempotency_outcome="executed"`, `otel_scope_name="github.com/idempotency-go/idempotency"`))
		assert.Regexp(t, `\nidempotency_outcomes_total\{[^}]*idempotency_outcome="executed"[^}]*\} 1\n`, body)
	})
	t.Run("wait", func(t *testing.T) {
		// Only the duplicate waited, about 100ms.
		in409 := `idempotency_outcome="in_flight"`
		assert.Equal(t, 1.0, sample(t, body, "idempotency_wait_duration_seconds_count", in409))
		assert.Equal(t, 1.0, sample(t, body, "idempotency_wait_duration_seconds_bucket", in409, `le="+Inf"`))
		assert.Equal(t, 0.0, sample(t, body, "idempotency_wait_duration_seconds_bucket", in409, `le="0.05"`))
		assert.GreaterOrEqual(t, sample(t, body, "idempotency_wait_duration_seconds_sum", in409), 0.1)
		assert.Len(t, samples(body, "idempotency_wait_duration_seconds_count"), 1, "a call that did not wait was counted")
	})
	t.Run("renewals", func(t *testing.T) {
		confirmed := sample(t, body, "idempotency_renewals_total", `idempotency_renewal_result="confirmed"`)
		assert.GreaterOrEqual(t, confirmed, 1.0)
		assert.Equal(t, confirmed, sample(t, body, "idempotency_renewal_duration_seconds_count", `idempotency_renewal_result="confirmed"`))
		assert.NotContains(t, body, `idempotency_renewal_result="failed"`)
	})
	t.Run("after the charge", func(t *testing.T) {
		assert.Equal(t, 0.0, sample(t, body, "idempotency_store_records", `idempotency_record_state="in_flight"`))
		assert.Equal(t, 0.0, sample(t, body, "idempotency_store_records", `idempotency_record_state="abandoned"`))
		assert.Equal(t, 0.0, sample(t, body, "idempotency_operation_count"))
		assert.Equal(t, 0.0, sample(t, body, "idempotency_waiter_count"))
		assert.NotContains(t, body, "idempotency_takeovers_total")
	})

	// An owner killed mid-charge leaves its record abandoned once its
	// lease runs out: another instance's scrape counts it, read from the
	// shared store, not from its own process.
	t.Run("abandoned", func(t *testing.T) {
		sent := inBackground(func() (reply, error) { return postCharge(a.url, "orphan", "", amountBody(100)) })
		awaitGatewayCharges(t, a.url, 2) // the first charge, then this one
		a.kill(t)
		require.Error(t, (<-sent).err, "the killed instance answered")
		b := start(t, "-redis", rs.Addr, "-lease", "1s")
		var body string
		require.Eventually(t, func() bool {
			r, err := send(http.MethodGet, b.url+"/metrics", "", nil)
			body = string(r.body)
			return err == nil && slices.Equal(samples(body, "idempotency_store_records", `idempotency_record_state="abandoned"`), []string{"1"})
		}, 10*time.Second, 50*time.Millisecond, "the killed owner's record was never counted abandoned")
		assert.Equal(t, 0.0, sample(t, body, "idempotency_store_records", `idempotency_record_state="in_flight"`))
		assert.Regexp(t, `\nidempotency_store_records\{idempotency_record_state="abandoned",[^}]*\} 1\n`, body)
		// b has served no call: the Guard's counters have no series yet.
		assert.NotContains(t, scrape(t, b.url), "idempotency_outcomes_total{")
	})
}
