package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// upstream is testdata/upstream.py, a service written in Python.
type upstream struct {
	url string
}

// startUpstream runs testdata/upstream.py until t ends.
func startUpstream(t *testing.T) upstream {
	t.Helper()
	return startPython(t, "testdata/upstream.py")
}

// startPython runs script with args, an upstream that prints "PORT <n>"
// once it listens on 127.0.0.1, until t ends. Without python3 it skips, unless
// IDEMPOTENCY_REQUIRE_SERVERS=1.
func startPython(t *testing.T, script string, args ...string) upstream {
	t.Helper()
	python, err := exec.LookPath("python3")
	if err != nil {
		if os.Getenv("IDEMPOTENCY_REQUIRE_SERVERS") == "1" {
			t.Fatalf("python3 is needed for the upstream: %v", err)
		}
		t.Skip("python3 not installed")
	}
	cmd := exec.Command(python, append([]string{script}, args...)...)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err, "the upstream's first line")
	port, ok := strings.CutPrefix(strings.TrimSpace(line), "PORT ")
	require.True(t, ok, "the upstream said %q", line)
	return upstream{url: "http://127.0.0.1:" + port}
}

// upstreamStats is what the upstream was asked.
type upstreamStats struct {
	Calls      map[string]int      `json:"calls"`      // by operation key
	Charges    map[string]string   `json:"charges"`    // by operation key
	Operations map[string][]string `json:"operations"` // operation keys by "scope/Idempotency-Key"
	Performed  map[string]int      `json:"performed"`  // charges made on /ledger, by operation key
}

func (u upstream) stats(t *testing.T) upstreamStats {
	t.Helper()
	resp, err := http.Get(u.url + "/_stats")
	require.NoError(t, err)
	defer resp.Body.Close()
	var s upstreamStats
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&s))
	return s
}

// operation returns the one operation key the upstream saw for key in
// scope, and how many calls it got: a key that reached the upstream under
// two operation keys would be run twice by any upstream.
func (u upstream) operation(t *testing.T, scope, key string) (op string, calls int) {
	t.Helper()
	s := u.stats(t)
	ops := s.Operations[scope+"/"+key]
	require.Len(t, ops, 1, "operation keys the upstream saw for %s/%s", scope, key)
	return ops[0], s.Calls[ops[0]]
}

// proxy is an `idempotency proxy` running in this process.
type proxy struct {
	url, admin string
	stop       func() // shuts it down, waiting for it to return
	// stdout is what it printed after its first line: its access log.
	stdout func() string
}

var servingLine = regexp.MustCompile(`serving (\S+) for [^,\s]+(?:, /healthz and /metrics on (\S+))?`)

// startProxy runs `idempotency STOREFLAGS proxy -upstream u ARGS` on free
// loopback ports until t ends.
func startProxy(t *testing.T, storeFlags []string, u upstream, args ...string) proxy {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	all := append(append(append([]string{}, storeFlags...), "proxy", "-upstream", u.url,
		"-listen", "127.0.0.1:0", "-admin-listen", "127.0.0.1:0", "-scope-header", "X-Account-ID"), args...)
	done := make(chan int, 1)
	var logs bytes.Buffer
	go func() {
		done <- run(ctx, all, strings.NewReader(""), pw, &lockedWriter{w: &logs})
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	var out bytes.Buffer
	stdout := &lockedWriter{w: &out}
	go func() { _, _ = io.Copy(stdout, pr) }()
	if err != nil {
		cancel()
		t.Fatalf("the proxy did not start (exit %d): %s", <-done, logs.String())
	}
	m := servingLine.FindStringSubmatch(line)
	require.NotNil(t, m, "the proxy said %q", line)
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			assert.Equal(t, 0, <-done, "the proxy's exit code")
		})
	}
	t.Cleanup(stop)
	return proxy{url: "http://" + m[1], admin: "http://" + m[2], stop: stop, stdout: func() string {
		stdout.mu.Lock()
		defer stdout.mu.Unlock()
		return out.String()
	}}
}

// lockedWriter is a writer safe for concurrent use.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// answer is a response, read whole.
type answer struct {
	status int
	header http.Header
	body   string
}

// noRedirects is a client that returns every answer as it came: the proxy
// passes an upstream's redirect on, and a test looks at it.
var noRedirects = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

// post sends body to path under key, in account scope, through base.
func post(t *testing.T, base, path, scope, key, body string, header ...string) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, base+path, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	if scope != "" {
		req.Header.Set("X-Account-ID", scope)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := noRedirects.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return answer{resp.StatusCode, resp.Header, string(b)}
}

// charge is the upstream's answer to a charge.
type charge struct {
	ID      string            `json:"id"`
	Request string            `json:"request"`
	Seen    map[string]string `json:"seen"`
	// Environ is what a Rack or WSGI server would make of the headers:
	// HTTP_ variables, each with every value the spellings of its name had.
	Environ map[string][]string `json:"environ"`
}

func decodeCharge(t *testing.T, a answer) charge {
	t.Helper()
	require.Equal(t, http.StatusCreated, a.status, "answer %s", a.body)
	var c charge
	require.NoError(t, json.Unmarshal([]byte(a.body), &c), "body %q", a.body)
	return c
}

// TestProxy runs the proxy's contract against an upstream written in
// Python, with two proxies sharing each store.
func TestProxy(t *testing.T) {
	for name, open := range stores(t) {
		t.Run(name, func(t *testing.T) {
			s := open(t)
			u := startUpstream(t)
			one, two := startProxy(t, s.flags, u), startProxy(t, s.flags, u)
			t.Run("RetriesReplay", func(t *testing.T) { testProxyReplays(t, u, one, two) })
			t.Run("ConcurrentDuplicates", func(t *testing.T) { testProxyDuplicates(t, u, one, two) })
			t.Run("KeyReused", func(t *testing.T) { testProxyKeyReused(t, u, one) })
			t.Run("Upstream5xx", func(t *testing.T) { testProxyUpstream5xx(t, u, one, two) })
			t.Run("Headers", func(t *testing.T) { testProxyHeaders(t, u, one) })
		})
	}
}

// A retry, through the same proxy or another, gets the stored answer
// byte for byte, and the upstream ran once.
func testProxyReplays(t *testing.T, u upstream, one, two proxy) {
	first := post(t, one.url, "/charges", "acct_1", "replay-1", `{"amount":100}`)
	c := decodeCharge(t, first)
	assert.Equal(t, `{"amount":100}`, c.Request)
	assert.Empty(t, first.header.Get("Idempotent-Replayed"))
	for _, p := range []proxy{one, two, two} {
		again := post(t, p.url, "/charges", "acct_1", "replay-1", `{"amount":100}`)
		assert.Equal(t, http.StatusCreated, again.status)
		assert.Equal(t, first.body, again.body)
		assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	}
	_, calls := u.operation(t, "acct_1", "replay-1")
	assert.Equal(t, 1, calls, "upstream calls")

	// The same key in another account is another operation.
	other := decodeCharge(t, post(t, two.url, "/charges", "acct_2", "replay-1", `{"amount":100}`))
	assert.NotEqual(t, c.ID, other.ID)
	_, calls = u.operation(t, "acct_2", "replay-1")
	assert.Equal(t, 1, calls)
}

// Concurrent duplicates through two proxies wait for the first and get its
// answer; the upstream runs once.
func testProxyDuplicates(t *testing.T, u upstream, one, two proxy) {
	const n = 16
	answers := make([]answer, n)
	var wg sync.WaitGroup
	for i := range n {
		p := []proxy{one, two}[i%2]
		wg.Go(func() { answers[i] = post(t, p.url, "/slow?ms=300", "acct_1", "dup-1", `{"amount":7}`) })
	}
	wg.Wait()
	for _, a := range answers {
		assert.Equal(t, http.StatusCreated, a.status)
		assert.Equal(t, answers[0].body, a.body)
	}
	_, calls := u.operation(t, "acct_1", "dup-1")
	assert.Equal(t, 1, calls, "upstream calls for %d concurrent duplicates", n)
}

// The key reused with another request gets 422, and nothing runs.
func testProxyKeyReused(t *testing.T, u upstream, one proxy) {
	decodeCharge(t, post(t, one.url, "/charges", "acct_1", "reused-1", `{"amount":1}`))
	a := post(t, one.url, "/charges", "acct_1", "reused-1", `{"amount":2}`)
	assert.Equal(t, http.StatusUnprocessableEntity, a.status)
	assert.Contains(t, a.body, "key-reused")
	_, calls := u.operation(t, "acct_1", "reused-1")
	assert.Equal(t, 1, calls)
	assert.Equal(t, http.StatusBadRequest, post(t, one.url, "/charges", "", "no-scope", `{}`).status, "no account header")
}

// An upstream 5xx is passed on and releases the key: the retry runs the
// upstream again, under the same operation key, and its answer is kept.
func testProxyUpstream5xx(t *testing.T, u upstream, one, two proxy) {
	failed := post(t, one.url, "/flaky", "acct_1", "flaky-1", `{}`)
	assert.Equal(t, http.StatusInternalServerError, failed.status)
	ok := decodeCharge(t, post(t, two.url, "/flaky", "acct_1", "flaky-1", `{}`))
	assert.Equal(t, "2", ok.Seen["Idempotency-Attempt"])
	again := post(t, one.url, "/flaky", "acct_1", "flaky-1", `{}`)
	assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	op, calls := u.operation(t, "acct_1", "flaky-1")
	assert.Equal(t, 2, calls, "upstream calls: the failed one and the retry")
	assert.Equal(t, op, ok.Seen["Idempotency-Operation-Key"])
}

// The upstream gets the operation's headers, never a client's forgery of
// them, the forwarding headers, and no hop-by-hop header.
func testProxyHeaders(t *testing.T, u upstream, one proxy) {
	c := decodeCharge(t, post(t, one.url, "/charges", "acct_1", "headers-1", `{}`,
		"Idempotency-Fencing-Token", "999999", "Idempotency-Operation-Key", "forged",
		"Connection", "X-Secret", "X-Secret", "hop"))
	op, _ := u.operation(t, "acct_1", "headers-1")
	assert.Equal(t, op, c.Seen["Idempotency-Operation-Key"])
	assert.True(t, strings.HasPrefix(op, "idem_"), "operation key %q", op)
	assert.NotEqual(t, "999999", c.Seen["Idempotency-Fencing-Token"])
	assert.Regexp(t, `^[1-9][0-9]*$`, c.Seen["Idempotency-Fencing-Token"])
	assert.Equal(t, "1", c.Seen["Idempotency-Attempt"])
	assert.Equal(t, "127.0.0.1", c.Seen["X-Forwarded-For"])
	assert.NotEmpty(t, c.Seen["X-Forwarded-Host"])
	assert.Empty(t, c.Seen["X-Secret"], "a hop-by-hop header reached the upstream")

	// A request of a method not guarded passes through, with no
	// operation headers, forged or not.
	req, err := http.NewRequest(http.MethodGet, one.url+"/anything", nil)
	require.NoError(t, err)
	req.Header.Set("Idempotency-Fencing-Token", "999999")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	var echoed struct{ Headers map[string]string }
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&echoed))
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.NotContains(t, echoed.Headers, "Idempotency-Fencing-Token")
}

// An upstream that hangs is cancelled at -operation-timeout: the client
// gets 504, the key is released, and its retry runs again under the same
// operation key, with a greater fencing token.
func TestProxyUpstreamHangs(t *testing.T) {
	s := stores(t)["redis"](t)
	u := startUpstream(t)
	p := startProxy(t, s.flags, u, "-operation-timeout", "400ms")
	start := time.Now()
	a := post(t, p.url, "/hang", "acct_1", "hang-1", `{}`)
	assert.Equal(t, http.StatusGatewayTimeout, a.status)
	assert.Less(t, time.Since(start), 5*time.Second, "the hung upstream held the client")
	b := post(t, p.url, "/hang", "acct_1", "hang-1", `{}`)
	assert.Equal(t, http.StatusGatewayTimeout, b.status, "the retry ran again and timed out again")
	_, calls := u.operation(t, "acct_1", "hang-1")
	assert.Equal(t, 2, calls)
}

// An answer above -max-response-bytes is streamed to the client whole and
// stored without its body, as the middleware does.
func TestProxyLargeAnswer(t *testing.T) {
	s := stores(t)["redis"](t)
	u := startUpstream(t)
	p := startProxy(t, s.flags, u, "-max-response-bytes", "65536")
	a := post(t, p.url, "/big?bytes=200000", "acct_1", "big-1", `{}`)
	assert.Equal(t, http.StatusCreated, a.status)
	assert.Len(t, a.body, 200000)
	b := post(t, p.url, "/big?bytes=200000", "acct_1", "big-1", `{}`)
	assert.Equal(t, http.StatusCreated, b.status)
	assert.Equal(t, "true", b.header.Get("Idempotent-Replayed"))
	assert.Equal(t, "too-large", b.header.Get("Idempotent-Body-Omitted"))
	assert.Empty(t, b.body)
	_, calls := u.operation(t, "acct_1", "big-1")
	assert.Equal(t, 1, calls)
}

// A shutdown finishes the requests under way, their answers stored; the
// admin listener serves /healthz and the library's metrics.
func TestProxyShutdownAndAdmin(t *testing.T) {
	s := stores(t)["redis"](t)
	u := startUpstream(t)
	p, other := startProxy(t, s.flags, u), startProxy(t, s.flags, u)

	resp, err := http.Get(p.admin + "/healthz")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	decodeCharge(t, post(t, p.url, "/charges", "acct_1", "metrics-1", `{}`))
	resp, err = http.Get(p.admin + "/metrics")
	require.NoError(t, err)
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Contains(t, string(metrics), "idempotency_outcomes_total")

	slow := make(chan answer, 1)
	go func() { slow <- post(t, p.url, "/slow?ms=700", "acct_1", "shutdown-1", `{}`) }()
	time.Sleep(200 * time.Millisecond)
	p.stop()
	first := <-slow
	decodeCharge(t, first)
	again := post(t, other.url, "/slow?ms=700", "acct_1", "shutdown-1", `{}`)
	assert.Equal(t, first.body, again.body)
	assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
}

// The proxy refuses a command line that would guard nothing or share keys
// between accounts.
func TestProxyRefusals(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-redis", "redis://127.0.0.1:1", "proxy", "-scope-header", "X-Account-ID"}, "-upstream is required"},
		{[]string{"-redis", "redis://127.0.0.1:1", "proxy", "-upstream", "http://127.0.0.1:1"}, "-scope-header is required"},
		{[]string{"-redis", "redis://127.0.0.1:1", "proxy", "-upstream", "ftp://x", "-single-tenant"}, "want http://host:port"},
		{[]string{"-redis", "redis://127.0.0.1:1", "proxy", "-upstream", "http://127.0.0.1:1", "-single-tenant", "-errors", "xml"}, "want problem or stripe"},
		{[]string{"proxy", "-upstream", "http://127.0.0.1:1", "-single-tenant"}, "name exactly one store"},
	} {
		code, _, stderr := command(t, "", c.args...)
		assert.Equal(t, 2, code, "%v: %s", c.args, stderr)
		assert.Contains(t, stderr, c.want, "%v", c.args)
	}
	t.Setenv("IDEMPOTENCY_UPSTREAM", "http://127.0.0.1:1")
	code, _, stderr := command(t, "", "-redis", "redis://127.0.0.1:1", "proxy", "-single-tenant", "-upstream", "gopher://x")
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, "gopher://x", "the command line wins over the environment")
	code, _, stderr = command(t, "", "-redis", "redis://127.0.0.1:1", "proxy")
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, "-scope-header is required", "the upstream came from the environment")
}

// TestOneProc: the command runs Go code on one thread (docs/proxy.md,
// "Added latency"), unless GOMAXPROCS says otherwise.
func TestOneProc(t *testing.T) {
	prev := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(prev) })
	runtime.GOMAXPROCS(2)
	oneProc(func(string) string { return "2" })
	assert.Equal(t, 2, runtime.GOMAXPROCS(0), "with GOMAXPROCS set, the runtime's")
	oneProc(func(string) string { return "" })
	assert.Equal(t, 1, runtime.GOMAXPROCS(0), "without")
}
