package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestProxyLatency measures what the proxy adds to a request's latency, and
// asserts nothing about it: it logs, for each kind of upstream, the p50 and
// p99 of N requests sent to the upstream alone, and of N new operations and
// N replays through a proxy process on Redis, interleaved so that a change
// in the machine's load weighs on all three alike. The client opens a
// connection per request. IDEMPOTENCY_LATENCY_REQUESTS sets N (200 by
// default); docs/proxy.md's "Added latency" gives the command and figures.
func TestProxyLatency(t *testing.T) {
	if testing.Short() {
		t.Skip("a measurement")
	}
	n := 200
	if v := os.Getenv("IDEMPOTENCY_LATENCY_REQUESTS"); v != "" {
		var err error
		n, err = strconv.Atoi(v)
		require.NoError(t, err, "IDEMPOTENCY_LATENCY_REQUESTS")
	}
	s := stores(t)["redis"](t)
	var table strings.Builder
	fmt.Fprintf(&table, "%d requests each, a connection per request\n", n)
	fmt.Fprintf(&table, "%-26s %-14s %9s %9s %9s %9s\n", "upstream", "request", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms")
	for _, kind := range []struct{ name, flag string }{
		{"http.server", ""},
		{"http.server, TCP_NODELAY", "--nodelay"},
	} {
		var u upstream
		if kind.flag == "" {
			u = startPython(t, "testdata/upstream.py")
		} else {
			u = startPython(t, "testdata/upstream.py", kind.flag)
		}
		p := startProxyProcess(t, s.flags, u)
		direct, fresh, replay := measureLatency(t, u.url, "http://"+p.addr, kind.flag, n)
		for _, row := range []struct {
			name string
			d    []time.Duration
		}{{"upstream alone", direct}, {"proxy, new", fresh}, {"proxy, replay", replay}} {
			fmt.Fprintf(&table, "%-26s %-14s %9.3f %9.3f %9.3f %9.3f\n", kind.name, row.name,
				ms(quantile(row.d, 0.5)), ms(quantile(row.d, 0.99)),
				ms(quantile(row.d, 0.5)-quantile(direct, 0.5)), ms(quantile(row.d, 0.99)-quantile(direct, 0.99)))
		}
	}
	t.Log("\n" + table.String())
}

// measureLatency sends n rounds of three requests, each on a new
// connection: one to the upstream alone, one new operation through the
// proxy, and a replay of the operation of the round before (so that the
// replay does not follow its original on the heels). It returns the
// durations of each kind, from the request's start to its body's end.
func measureLatency(t *testing.T, upstreamURL, proxyURL, tag string, n int) (direct, fresh, replay []time.Duration) {
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	timed := func(url, key string, want int) time.Duration {
		req, err := http.NewRequest(http.MethodPost, url+"/charges", strings.NewReader(`{"amount":100}`))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Account-ID", "acct_latency")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		start := time.Now()
		resp, err := client.Do(req)
		require.NoError(t, err)
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		d := time.Since(start)
		require.NoError(t, err)
		require.Equal(t, want, resp.StatusCode, "POST %s/charges key %q", url, key)
		return d
	}
	key := func(i int) string { return fmt.Sprintf("latency%s-%d", tag, i) }
	for i := range n + 1 {
		if i < n {
			direct = append(direct, timed(upstreamURL, "", http.StatusCreated))
			fresh = append(fresh, timed(proxyURL, key(i), http.StatusCreated))
		}
		if i > 0 {
			replay = append(replay, timed(proxyURL, key(i-1), http.StatusCreated))
		}
	}
	return direct, fresh, replay
}

// quantile is the q-quantile of d (nearest rank), 0 for none.
func quantile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(q*float64(len(s))+0.5) - 1
	return s[max(0, min(i, len(s)-1))]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
