package main

// Black-box tests: each test runs the payments binary as separate processes
// over a real Redis or PostgreSQL, talks HTTP to them, and kills, stops and
// continues them with signals.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testserver"
)

// binary is the payments command, built once by TestMain.
var binary string

// buildFlags are added to go build; race_test.go adds -race, so that the
// server processes run under the race detector when the tests do.
var buildFlags []string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "payments-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "payments")
	args := append(append([]string{"build"}, buildFlags...), "-o", binary, ".")
	if out, err := exec.Command("go", args...).CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "go %s: %v\n%s", strings.Join(args, " "), err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

const chargeBody = `{"amount": 4200, "currency": "usd", "source": "tok_visa"}`

// instance is one running payments process.
type instance struct {
	url    string
	cmd    *exec.Cmd
	exited chan struct{} // closed once the process has exited and been reaped
	mu     sync.Mutex
	log    bytes.Buffer // its stderr
	err    error        // what Wait returned, once exited is closed
}

// start runs the binary with args on a free port, waits until it listens,
// and kills it when the test ends. Its stderr is logged if the test fails;
// a data race reported in it fails the test.
func start(t *testing.T, args ...string) *instance {
	t.Helper()
	cmd := exec.Command(binary, append([]string{"-addr", "127.0.0.1:0"}, args...)...)
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	in := &instance{cmd: cmd, exited: make(chan struct{})}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			line := sc.Text()
			in.mu.Lock()
			in.log.WriteString(line + "\n")
			in.mu.Unlock()
			if _, a, ok := strings.Cut(line, "listening on "); ok {
				select {
				case addr <- a:
				default:
				}
			}
		}
		// Wait closes the pipe, so it must come after the last read.
		in.err = cmd.Wait()
		close(in.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-in.exited
		log := in.stderr()
		if strings.Contains(log, "DATA RACE") {
			t.Errorf("%s: the race detector reported a race:\n%s", args, log)
		} else if t.Failed() {
			t.Logf("%s stderr:\n%s", args, log)
		}
	})
	select {
	case a := <-addr:
		in.url = "http://" + a
	case <-in.exited:
		t.Fatalf("payments %s exited before listening (%v):\n%s", args, in.err, in.stderr())
	case <-time.After(20 * time.Second):
		t.Fatalf("payments %s did not listen within 20s:\n%s", args, in.stderr())
	}
	return in
}

func (in *instance) stderr() string {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.log.String()
}

func (in *instance) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	require.NoError(t, in.cmd.Process.Signal(sig))
}

// kill kills the process with SIGKILL, as a crash would, and waits for it
// to be gone.
func (in *instance) kill(t *testing.T) {
	t.Helper()
	in.signal(t, syscall.SIGKILL)
	<-in.exited
}

// reply is an HTTP response read whole.
type reply struct {
	status int
	header http.Header
	body   []byte
}

func (r reply) replayed() bool { return r.header.Get("Idempotent-Replayed") == "true" }

func (r reply) String() string { return fmt.Sprintf("%d %s", r.status, r.body) }

// client has a generous timeout: a request may wait out a lease, or for a
// stopped process to continue.
var client = &http.Client{Timeout: 30 * time.Second}

func send(method, url, body string, header http.Header) (reply, error) {
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	for name, vs := range header {
		req.Header[name] = vs
	}
	res, err := client.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return reply{status: res.StatusCode, header: res.Header, body: b}, err
}

// postCharge posts body to /v1/charges under key (none if "") for the
// account (none if "").
func postCharge(base, key, account, body string) (reply, error) {
	h := http.Header{"Content-Type": {"application/json"}}
	if key != "" {
		h.Set("Idempotency-Key", key)
	}
	if account != "" {
		h.Set("X-Account-ID", account)
	}
	return send(http.MethodPost, base+"/v1/charges", body, h)
}

func getJSON[T any](t *testing.T, url string) T {
	t.Helper()
	r, err := send(http.MethodGet, url, "", nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, r.status, "GET %s: %s", url, r)
	require.Equal(t, "application/json", r.header.Get("Content-Type"))
	var v T
	require.NoError(t, json.Unmarshal(r.body, &v), "GET %s: %s", url, r)
	return v
}

// chargeOf decodes a 201 reply's charge.
func chargeOf(t *testing.T, r reply) charge {
	t.Helper()
	require.Equal(t, http.StatusCreated, r.status, "%s", r)
	var c charge
	require.NoError(t, json.Unmarshal(r.body, &c), "%s", r)
	return c
}

// requireProblem checks an RFC 9457 answer and returns its type.
func requireProblem(t *testing.T, r reply, status int) string {
	t.Helper()
	require.Equal(t, status, r.status, "%s", r)
	require.Equal(t, "application/problem+json", r.header.Get("Content-Type"))
	var p struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
	}
	require.NoError(t, json.Unmarshal(r.body, &p), "%s", r)
	assert.Equal(t, status, p.Status)
	assert.NotEmpty(t, p.Title)
	assert.NotEmpty(t, p.Detail)
	return p.Type
}

// requireReplayOf checks that r replays original byte for byte.
func requireReplayOf(t *testing.T, original, r reply) {
	t.Helper()
	require.Equal(t, original.status, r.status, "%s", r)
	require.True(t, r.replayed(), "not marked replayed: %v", r.header)
	require.Equal(t, string(original.body), string(r.body))
	for _, name := range []string{"Content-Type", "Location"} {
		require.Equal(t, original.header.Values(name), r.header.Values(name), name)
	}
}

// awaitGatewayCharge waits until the gateway has made a charge, which it
// does at the start of a call, before its latency.
func awaitGatewayCharge(t *testing.T, base string) {
	t.Helper()
	require.Eventually(t, func() bool {
		r, err := send(http.MethodGet, base+"/v1/gateway", "", nil)
		var s gatewayStats
		return err == nil && json.Unmarshal(r.body, &s) == nil && s.Charges >= 1
	}, 10*time.Second, 10*time.Millisecond, "the gateway never made a charge")
}

// retryUntilCreated retries a charge as a client would: 409 (the original
// still in flight) and 503 mean try again later; anything else ends it.
func retryUntilCreated(t *testing.T, base, key string) reply {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for backoff := 50 * time.Millisecond; ; backoff = min(2*backoff, time.Second) {
		r, err := postCharge(base, key, "", chargeBody)
		require.NoError(t, err)
		if r.status != http.StatusConflict && r.status != http.StatusServiceUnavailable {
			require.Equal(t, http.StatusCreated, r.status, "%s", r)
			return r
		}
		require.True(t, time.Now().Before(deadline), "still %s after 15s", r)
		time.Sleep(backoff)
	}
}

// inBackground runs f on its own goroutine; the channel delivers its result.
func inBackground(f func() (reply, error)) <-chan result {
	c := make(chan result, 1)
	go func() {
		r, err := f()
		c <- result{r, err}
	}()
	return c
}

type result struct {
	reply
	err error
}

func TestContract(t *testing.T) {
	t.Parallel()
	p := start(t) // the embedded Redis
	assert.Contains(t, p.stderr(), "not shared between processes")

	first, err := postCharge(p.url, "key-1", "acct_1", chargeBody)
	require.NoError(t, err)
	c := chargeOf(t, first)
	assert.False(t, first.replayed())
	assert.Equal(t, "application/json", first.header.Get("Content-Type"))
	assert.Equal(t, "/v1/charges/"+c.ID, first.header.Get("Location"))
	assert.Regexp(t, `^ch_[a-z0-9]+$`, c.ID)
	assert.Equal(t, charge{ID: c.ID, Amount: 4200, Currency: "usd", Source: "tok_visa", Status: "succeeded"}, c)

	t.Run("replay", func(t *testing.T) {
		for _, body := range []string{chargeBody, `{"source":"tok_visa","currency":"usd","amount":4200}`} {
			r, err := postCharge(p.url, "key-1", "acct_1", body)
			require.NoError(t, err)
			requireReplayOf(t, first, r)
		}
	})
	t.Run("different request under a used key", func(t *testing.T) {
		r, err := postCharge(p.url, "key-1", "acct_1", `{"amount": 4300, "currency": "usd", "source": "tok_visa"}`)
		require.NoError(t, err)
		assert.Equal(t, "https://pkg.go.dev/github.com/idempotency-go/idempotency#ErrMismatch", requireProblem(t, r, http.StatusUnprocessableEntity))
	})
	t.Run("the key belongs to its account", func(t *testing.T) {
		r, err := postCharge(p.url, "key-1", "acct_2", chargeBody)
		require.NoError(t, err)
		assert.False(t, r.replayed())
		assert.NotEqual(t, c.ID, chargeOf(t, r).ID)
	})
	t.Run("invalid input is not stored", func(t *testing.T) {
		for _, body := range []string{
			`{"amount": 4200, "currency": "usd"`,
			`{"amount": 4200, "currency": "usd", "source": "tok_visa", "capture": true}`,
			`{"amount": 0, "currency": "usd", "source": "tok_visa"}`,
			`{"amount": -1, "currency": "usd", "source": "tok_visa"}`,
			`{"amount": 42.5, "currency": "usd", "source": "tok_visa"}`,
			`{"amount": 4200, "currency": "USD", "source": "tok_visa"}`,
			`{"amount": 4200, "currency": "usdx", "source": "tok_visa"}`,
			`{"amount": 4200, "currency": "usd", "source": ""}`,
			`{"amount": 4200, "currency": "usd", "source": "tok_visa"} {}`,
		} {
			// Every one under the same key: a 400 is forgotten, so the
			// next body is judged afresh rather than as a mismatch.
			r, err := postCharge(p.url, "key-fixed", "acct_1", body)
			require.NoError(t, err)
			assert.Equal(t, "https://payments.example/problems/invalid-charge", requireProblem(t, r, http.StatusBadRequest), body)
		}
		r, err := postCharge(p.url, "key-fixed", "acct_1", chargeBody)
		require.NoError(t, err)
		assert.False(t, r.replayed())
		assert.NotEqual(t, c.ID, chargeOf(t, r).ID)
	})
	t.Run("no key", func(t *testing.T) {
		r, err := postCharge(p.url, "", "acct_1", chargeBody)
		require.NoError(t, err)
		assert.Equal(t, "https://pkg.go.dev/github.com/idempotency-go/idempotency#problem-missing-key", requireProblem(t, r, http.StatusBadRequest))
	})
	t.Run("reads", func(t *testing.T) {
		ledger := getJSON[[]charge](t, p.url+"/v1/charges")
		require.Len(t, ledger, 3)
		assert.Contains(t, ledger, c)
		assert.Equal(t, c, getJSON[charge](t, p.url+first.header.Get("Location")))
		r, err := send(http.MethodGet, p.url+"/v1/charges/ch_none", "", nil)
		require.NoError(t, err)
		requireProblem(t, r, http.StatusNotFound)
		assert.Equal(t, gatewayStats{Calls: 3, Charges: 3}, getJSON[gatewayStats](t, p.url+"/v1/gateway"))
		r, err = send(http.MethodGet, p.url+"/healthz", "", nil)
		require.NoError(t, err)
		assert.Equal(t, "200 ok", r.String())
	})
	t.Run("SIGTERM shuts down cleanly", func(t *testing.T) {
		p.signal(t, syscall.SIGTERM)
		select {
		case <-p.exited:
			require.NoError(t, p.err)
		case <-time.After(10 * time.Second):
			t.Fatal("still running 10s after SIGTERM")
		}
	})
}

// requireOneService checks that instances sharing a store act as one service.
func requireOneService(t *testing.T, instances []*instance) {
	// Concurrent duplicates of one request, spread over every instance.
	const duplicates = 60
	one := concurrently(duplicates, func(i int) (reply, error) {
		return postCharge(instances[i%len(instances)].url, "one-key", "", chargeBody)
	})
	original := one[0]
	for _, r := range one {
		if !r.replayed() {
			original = r
		}
	}
	c := chargeOf(t, original)
	replays := 0
	for _, r := range one {
		if r.replayed() {
			replays++
			requireReplayOf(t, original, r)
		}
	}
	assert.Equal(t, duplicates-1, replays, "exactly one request ran the handler")
	base := instances[0].url
	assert.Equal(t, gatewayStats{Calls: 1, Charges: 1}, getJSON[gatewayStats](t, base+"/v1/gateway"))
	assert.Equal(t, []charge{c}, getJSON[[]charge](t, base+"/v1/charges"))

	// Many keys at once, each sent several times to several instances.
	const keys, copies = 20, 5
	many := concurrently(keys*copies, func(i int) (reply, error) {
		k, n := i/copies, i%copies
		body := fmt.Sprintf(`{"amount": %d, "currency": "eur", "source": "tok_%d"}`, 100+k, k)
		return postCharge(instances[(k+n)%len(instances)].url, fmt.Sprintf("key-%d", k), "", body)
	})
	ids := map[string]bool{c.ID: true}
	for k := range keys {
		group := many[k*copies : (k+1)*copies]
		id := chargeOf(t, group[0]).ID
		ids[id] = true
		for _, r := range group {
			require.Equal(t, string(group[0].body), string(r.body), "key-%d", k)
			assert.Equal(t, int64(100+k), chargeOf(t, r).Amount)
		}
	}
	assert.Len(t, ids, 1+keys)
	for _, in := range instances {
		assert.Equal(t, gatewayStats{Calls: 1 + keys, Charges: 1 + keys}, getJSON[gatewayStats](t, in.url+"/v1/gateway"))
		assert.Len(t, getJSON[[]charge](t, in.url+"/v1/charges"), 1+keys)
	}
}

// concurrently runs n calls of f at once and returns their replies in order.
func concurrently(n int, f func(i int) (reply, error)) []reply {
	replies := make([]reply, n)
	errs := make([]error, n)
	ready := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-ready
			replies[i], errs[i] = f(i)
		})
	}
	close(ready)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			replies[i] = reply{status: -1, body: []byte(err.Error())}
		}
	}
	return replies
}

func TestInstancesOnRedisActAsOne(t *testing.T) {
	t.Parallel()
	r := testserver.StartRedis(t)
	var instances []*instance
	for range 3 {
		instances = append(instances, start(t, "-redis", r.Addr))
	}
	requireOneService(t, instances)
}

func TestInstancesOnPostgresActAsOne(t *testing.T) {
	t.Parallel()
	pg := testserver.StartPostgres(t)
	var instances []*instance
	for range 2 {
		instances = append(instances, start(t, "-postgres", pg.DSN))
	}
	requireOneService(t, instances)
}

// An owner killed after its gateway call made the charge, before it could
// answer: a retry on another instance takes over once the lease runs out,
// repeats the gateway call with the same downstream key, and so returns the
// charge that was already made instead of making a second.
func TestKilledOwnerIsTakenOver(t *testing.T) {
	t.Parallel()
	rs := testserver.StartRedis(t)
	a := start(t, "-redis", rs.Addr, "-work", "2s", "-lease", "1s")
	b := start(t, "-redis", rs.Addr, "-lease", "1s")

	orig := inBackground(func() (reply, error) { return postCharge(a.url, "crash", "", chargeBody) })
	awaitGatewayCharge(t, b.url)
	a.kill(t)
	require.Error(t, (<-orig).err, "the killed instance answered")

	r := retryUntilCreated(t, b.url, "crash")
	c := chargeOf(t, r)
	assert.False(t, r.replayed())
	made, err := rs.Client().HVals(t.Context(), gatewayChargesKey).Result()
	require.NoError(t, err)
	require.Len(t, made, 1, "the gateway made more than one charge")
	var original charge
	require.NoError(t, json.Unmarshal([]byte(made[0]), &original))
	assert.Equal(t, original, c, "the takeover did not get the charge the killed owner made")
	assert.Equal(t, gatewayStats{Calls: 2, Charges: 1}, getJSON[gatewayStats](t, b.url+"/v1/gateway"))
	assert.Equal(t, []charge{c}, getJSON[[]charge](t, b.url+"/v1/charges"))

	again, err := postCharge(b.url, "crash", "", chargeBody)
	require.NoError(t, err)
	requireReplayOf(t, r, again)
}

// An owner stopped past its lease is taken over; when it continues, its
// outcome is refused (fenced off), and everyone sees the takeover's answer.
func TestStalledOwnerIsFencedOff(t *testing.T) {
	t.Parallel()
	rs := testserver.StartRedis(t)
	a := start(t, "-redis", rs.Addr, "-work", "1500ms", "-lease", "500ms")
	b := start(t, "-redis", rs.Addr, "-lease", "500ms")

	orig := inBackground(func() (reply, error) { return postCharge(a.url, "stall", "", chargeBody) })
	awaitGatewayCharge(t, b.url)
	a.signal(t, syscall.SIGSTOP)
	r := retryUntilCreated(t, b.url, "stall")
	c := chargeOf(t, r)
	a.signal(t, syscall.SIGCONT)

	var stale result
	select {
	case stale = <-orig:
	case <-time.After(20 * time.Second):
		t.Fatal("the stalled owner never answered after SIGCONT")
	}
	require.NoError(t, stale.err)
	assert.Equal(t, "https://pkg.go.dev/github.com/idempotency-go/idempotency#ErrFenced",
		requireProblem(t, stale.reply, http.StatusServiceUnavailable))

	for _, in := range []*instance{a, b} {
		again, err := postCharge(in.url, "stall", "", chargeBody)
		require.NoError(t, err)
		requireReplayOf(t, r, again)
	}
	assert.Equal(t, gatewayStats{Calls: 2, Charges: 1}, getJSON[gatewayStats](t, b.url+"/v1/gateway"))
	assert.Equal(t, []charge{c}, getJSON[[]charge](t, a.url+"/v1/charges"))
}

// A handler that runs for four leases keeps its record by heartbeats: a
// duplicate on another instance waits for it and gets its answer, and the
// gateway is called once. (A lease of 1s rather than less: on a loaded
// 2-core machine running the race detector, a shorter one can truly be lost
// to a stall, which would be a correct takeover, not this test's case.)
func TestLongHandlerKeepsItsLease(t *testing.T) {
	t.Parallel()
	rs := testserver.StartRedis(t)
	a := start(t, "-redis", rs.Addr, "-work", "4s", "-lease", "1s", "-wait", "10s")
	b := start(t, "-redis", rs.Addr, "-lease", "1s", "-wait", "10s")

	orig := inBackground(func() (reply, error) { return postCharge(a.url, "long", "", chargeBody) })
	awaitGatewayCharge(t, b.url)
	dup, err := postCharge(b.url, "long", "", chargeBody)
	require.NoError(t, err)
	first := <-orig
	require.NoError(t, first.err)
	c := chargeOf(t, first.reply)
	assert.False(t, first.replayed())
	requireReplayOf(t, first.reply, dup)
	assert.Equal(t, gatewayStats{Calls: 1, Charges: 1}, getJSON[gatewayStats](t, b.url+"/v1/gateway"))
	assert.Equal(t, []charge{c}, getJSON[[]charge](t, b.url+"/v1/charges"))
}
