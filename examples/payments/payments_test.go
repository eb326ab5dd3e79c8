package main

// Black-box tests: each test runs the payments binary as separate processes
// over a real Redis or PostgreSQL, talks HTTP to them, and kills, stops and
// continues them with signals.

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
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

// logged waits until in's stderr matches re: the process logs as it
// answers, and its stderr reaches the test through a pipe a moment later.
func (in *instance) logged(t *testing.T, re string) {
	t.Helper()
	want := regexp.MustCompile(re)
	assert.Eventually(t, func() bool { return want.MatchString(in.stderr()) }, 5*time.Second, 10*time.Millisecond,
		"the log never matched %s:\n%s", re, in.stderr())
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
	return roundTrip(client, req)
}

// roundTrip sends req with c and reads the reply whole.
func roundTrip(c *http.Client, req *http.Request) (reply, error) {
	res, err := c.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return reply{status: res.StatusCode, header: res.Header, body: b}, err
}

// testAccount is the account of the tests' charges that name none.
const testAccount = "acct_test"

// postCharge posts body to /v1/charges under key (none if "") for the
// account (testAccount if "": the API refuses a charge that names none).
func postCharge(base, key, account, body string) (reply, error) {
	h := http.Header{"Content-Type": {"application/json"}, "X-Account-Id": {cmp.Or(account, testAccount)}}
	if key != "" {
		h.Set("Idempotency-Key", key)
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

// awaitGatewayCharges waits until the gateway has made n charges, which it
// does at the start of a call, before its latency.
func awaitGatewayCharges(t *testing.T, base string, n int64) {
	t.Helper()
	require.Eventually(t, func() bool {
		r, err := send(http.MethodGet, base+"/v1/gateway", "", nil)
		var s gatewayStats
		return err == nil && json.Unmarshal(r.body, &s) == nil && s.Charges >= n
	}, 10*time.Second, 10*time.Millisecond, "the gateway never made %d charges", n)
}

// awaitLedger waits until the ledger holds n charges and returns them.
func awaitLedger(t *testing.T, base string, n int) []charge {
	t.Helper()
	var ledger []charge
	require.Eventually(t, func() bool {
		r, err := send(http.MethodGet, base+"/v1/charges", "", nil)
		return err == nil && r.status == http.StatusOK && json.Unmarshal(r.body, &ledger) == nil && len(ledger) == n
	}, 15*time.Second, 20*time.Millisecond, "the ledger never held %d charges", n)
	return ledger
}

// gatewayCharges returns the charges the gateway made, read from Redis
// rather than through the service under test.
func gatewayCharges(t *testing.T, rs *testserver.Redis) []charge {
	t.Helper()
	made, err := rs.Client().HVals(t.Context(), gatewayChargesKey).Result()
	require.NoError(t, err)
	charges := make([]charge, len(made))
	for i, m := range made {
		require.NoError(t, json.Unmarshal([]byte(m), &charges[i]))
	}
	slices.SortFunc(charges, func(a, b charge) int { return strings.Compare(a.ID, b.ID) })
	return charges
}

// requireCreated checks that r is, byte for byte, the 201 the handler sends
// for c, marked replayed or not.
func requireCreated(t *testing.T, r reply, c charge, replayed bool) {
	t.Helper()
	want, err := json.Marshal(c)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, r.status, "%s", r)
	require.Equal(t, string(want)+"\n", string(r.body))
	require.Equal(t, []string{"application/json"}, r.header.Values("Content-Type"))
	require.Equal(t, []string{"/v1/charges/" + c.ID}, r.header.Values("Location"))
	require.Equal(t, replayed, r.replayed(), "Idempotent-Replayed: %v", r.header)
}

// retryUntilCreated retries a charge as a client would: 409 (the original
// still in flight) and 503 mean try again later; anything else ends it.
func retryUntilCreated(t *testing.T, base, key, body string) reply {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for backoff := 50 * time.Millisecond; ; backoff = min(2*backoff, time.Second) {
		r, err := postCharge(base, key, "", body)
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
		assert.Equal(t, idempotency.ProblemTypes+"key-reused", requireProblem(t, r, http.StatusUnprocessableEntity))
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
		assert.Equal(t, idempotency.ProblemTypes+"missing-key", requireProblem(t, r, http.StatusBadRequest))
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
		// The instances sweep: beside live owners, a sweep neither fails
		// nor settles anything.
		assert.NotContains(t, in.stderr(), "sweep:")
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

// startN starts n instances with the same flags: one service.
func startN(t *testing.T, n int, args ...string) []*instance {
	instances := make([]*instance, n)
	for i := range instances {
		instances[i] = start(t, args...)
	}
	return instances
}

func TestInstancesOnRedisActAsOne(t *testing.T) {
	t.Parallel()
	r := testserver.StartRedis(t)
	requireOneService(t, startN(t, 3, "-redis", r.Addr, "-sweep", "50ms"))
}

// The service refuses to start on a Redis that may evict its records: an
// evicted record's retry would charge again.
func TestRefusesAnEvictingRedis(t *testing.T) {
	t.Parallel()
	r := testserver.StartRedis(t, "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
	// Killed after a while if it serves after all: the checks below then fail.
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, binary, "-addr", "127.0.0.1:0", "-redis", r.Addr).CombinedOutput()
	require.Error(t, err)
	assert.NotContains(t, string(out), "listening on")
	assert.Contains(t, string(out), "evicts under maxmemory", "it did not say why:\n%s", out)
	assert.Contains(t, string(out), "allkeys-lru")
}

func TestInstancesOnClusterActAsOne(t *testing.T) {
	t.Parallel()
	cl := testserver.StartCluster(t, 3, 0)
	requireOneService(t, startN(t, 3, "-cluster", strings.Join(cl.Addrs, ","), "-sweep", "50ms"))
	// The records spread over every master, not one.
	for _, n := range cl.Nodes {
		assert.NotZero(t, n.Client().DBSize(t.Context()).Val(), "master %s holds no key", n.Addr)
	}
}

func TestInstancesOnPostgresActAsOne(t *testing.T) {
	t.Parallel()
	pg := testserver.StartPostgres(t)
	requireOneService(t, startN(t, 2, "-postgres", pg.DSN, "-sweep", "50ms"))
}

// On PostgreSQL a charge's ledger row and its stored answer are written by
// one transaction (the same xmin), and the client gets exactly the answer
// stored, which its retry replays.
func TestPostgresChargeCompletesInItsTransaction(t *testing.T) {
	t.Parallel()
	pg := testserver.StartPostgres(t)
	in := start(t, "-postgres", pg.DSN)
	first, err := postCharge(in.url, `"tx-1"`, "acct_1", amountBody(4200))
	require.NoError(t, err)
	c := chargeOf(t, first)
	again, err := postCharge(in.url, "tx-1", "acct_1", amountBody(4200))
	require.NoError(t, err)
	requireReplayOf(t, first, again)

	conn, err := pgx.Connect(t.Context(), pg.DSN)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var ledgerTx, recordTx string
	var stored []byte
	require.NoError(t, conn.QueryRow(t.Context(), `SELECT xmin::text FROM payments_ledger WHERE id = $1`, c.ID).Scan(&ledgerTx))
	require.NoError(t, conn.QueryRow(t.Context(),
		`SELECT xmin::text, response FROM idempotency_records WHERE scope = 'acct_1' AND key = 'tx-1'`).Scan(&recordTx, &stored))
	assert.Equal(t, ledgerTx, recordTx, "the ledger row and the answer were committed apart")
	assert.Contains(t, string(stored), string(first.body), "the stored answer is the one sent")
}

// killAfterCharging sends one charge per key to owner, each with its own
// amount (100+i for keys[i]), and kills owner once the gateway has made
// every charge: inside its -work latency, after the charges and before its
// ledger writes.
func killAfterCharging(t *testing.T, owner *instance, keys ...string) {
	t.Helper()
	sent := make([]<-chan result, len(keys))
	for i, k := range keys {
		sent[i] = inBackground(func() (reply, error) { return postCharge(owner.url, k, "", amountBody(100+i)) })
	}
	awaitGatewayCharges(t, owner.url, int64(len(keys)))
	owner.kill(t)
	for _, r := range sent {
		require.Error(t, (<-r).err, "the killed instance answered")
	}
}

func amountBody(amount int) string {
	return fmt.Sprintf(`{"amount": %d, "currency": "eur", "source": "tok_visa"}`, amount)
}

// An owner killed after its gateway call made the charge, before it could
// record it or answer: a client's retry on another instance takes over once
// the lease runs out, and the recovery hook finds the charge at the gateway
// under the operation's downstream key, records it and answers it, without
// calling the gateway again.
func TestKilledOwnerIsRecoveredByRetry(t *testing.T) {
	t.Parallel()
	rs := testserver.StartRedis(t)
	a := start(t, "-redis", rs.Addr, "-work", "2s", "-lease", "1s")
	b := start(t, "-redis", rs.Addr, "-lease", "1s")

	killAfterCharging(t, a, "crash")
	requireLedgerEmpty(t, rs)
	made := gatewayCharges(t, rs)
	require.Len(t, made, 1)

	r := retryUntilCreated(t, b.url, "crash", amountBody(100))
	requireCreated(t, r, made[0], true)
	assert.Equal(t, made, gatewayCharges(t, rs), "the gateway made another charge")
	assert.Equal(t, gatewayStats{Calls: 1, Charges: 1}, getJSON[gatewayStats](t, b.url+"/v1/gateway"))
	assert.Equal(t, made, getJSON[[]charge](t, b.url+"/v1/charges"))
	b.logged(t, regexp.QuoteMeta("had charged "+made[0].ID))

	again, err := postCharge(b.url, "crash", "", amountBody(100))
	require.NoError(t, err)
	requireReplayOf(t, r, again)
}

// An owner killed after the gateway charged, and a client that never
// retries: another instance's sweeper settles the operation on its own,
// recording the charge in the ledger and storing the handler's 201, which
// a later request gets as a replay.
func TestSweeperRecoversKilledOwner(t *testing.T) {
	t.Parallel()
	rs := testserver.StartRedis(t)
	a := start(t, "-redis", rs.Addr, "-work", "2s", "-lease", "500ms")
	killAfterCharging(t, a, "swept")
	// Checked before any other instance runs: nothing else can have
	// written the ledger yet.
	requireLedgerEmpty(t, rs)
	made := gatewayCharges(t, rs)
	require.Len(t, made, 1)

	b := start(t, "-redis", rs.Addr, "-lease", "500ms", "-sweep", "200ms")
	// No charge request is sent until the sweeper reports the operation
	// settled: the record is completed by the sweep alone.
	assert.Equal(t, made, awaitLedger(t, b.url, 1))
	awaitSettled(t, 1, b)
	b.logged(t, regexp.QuoteMeta("had charged "+made[0].ID))

	r, err := postCharge(b.url, "swept", "", amountBody(100))
	require.NoError(t, err)
	requireCreated(t, r, made[0], true)
	assert.Equal(t, gatewayStats{Calls: 1, Charges: 1}, getJSON[gatewayStats](t, b.url+"/v1/gateway"))
	assert.Equal(t, made, getJSON[[]charge](t, b.url+"/v1/charges"))
}

// requireLedgerEmpty checks, in Redis, that no charge was recorded.
func requireLedgerEmpty(t *testing.T, rs *testserver.Redis) {
	t.Helper()
	n, err := rs.Client().HLen(t.Context(), ledgerKey).Result()
	require.NoError(t, err)
	require.Zero(t, n, "a charge was recorded: the owner was killed too late")
}

// awaitSettled waits until the sweepers have reported settling n operations
// between them, and checks that they settled no more.
func awaitSettled(t *testing.T, n int, sweepers ...*instance) {
	t.Helper()
	total := func() int {
		sum := 0
		for _, in := range sweepers {
			sum += settledBy(in)
		}
		return sum
	}
	require.Eventually(t, func() bool { return total() >= n }, 15*time.Second, 20*time.Millisecond,
		"the sweepers never reported settling %d operations", n)
	require.Equal(t, n, total(), "operations settled")
}

// settledLine is what an instance logs after a sweep that settled records.
var settledLine = regexp.MustCompile(`sweep: settled (\d+) `)

// settledBy adds up the operations an instance reported it swept.
func settledBy(in *instance) int {
	n := 0
	for _, m := range settledLine.FindAllStringSubmatch(in.stderr(), -1) {
		i, _ := strconv.Atoi(m[1]) // \d+: a number
		n += i
	}
	return n
}

// Two sweepers racing over several abandoned operations settle each one
// exactly once: each charge is recovered by one hook run, on one of them,
// and the gateway is never called again.
func TestRacingSweepersSettleEachOnce(t *testing.T) {
	t.Parallel()
	rs := testserver.StartRedis(t)
	a := start(t, "-redis", rs.Addr, "-work", "2s", "-lease", "500ms")
	sweepers := []*instance{
		start(t, "-redis", rs.Addr, "-lease", "500ms", "-sweep", "100ms"),
		start(t, "-redis", rs.Addr, "-lease", "500ms", "-sweep", "100ms"),
	}

	keys := []string{"race-0", "race-1", "race-2", "race-3", "race-4"}
	killAfterCharging(t, a, keys...)
	made := gatewayCharges(t, rs)
	require.Len(t, made, len(keys))
	awaitSettled(t, len(keys), sweepers...)
	assert.Equal(t, made, getJSON[[]charge](t, sweepers[0].url+"/v1/charges"))
	logs := sweepers[0].stderr() + sweepers[1].stderr()
	for _, c := range made {
		assert.Equal(t, 1, strings.Count(logs, "had charged "+c.ID), "recoveries of %s", c.ID)
	}

	byAmount := map[int64]charge{}
	for _, c := range made {
		byAmount[c.Amount] = c
	}
	for i, k := range keys {
		r, err := postCharge(sweepers[i%2].url, k, "", amountBody(100+i))
		require.NoError(t, err)
		requireCreated(t, r, byAmount[int64(100+i)], true)
	}
	assert.Equal(t, gatewayStats{Calls: int64(len(keys)), Charges: int64(len(keys))},
		getJSON[gatewayStats](t, sweepers[1].url+"/v1/gateway"))
	assert.Equal(t, made, getJSON[[]charge](t, sweepers[1].url+"/v1/charges"))
}

// crashedOwner is a Store through which a Guard claims records and then
// loses every write, as an owner whose process dies right after its claim
// would: the record stays in flight, attempt 1, until its lease runs out.
type crashedOwner struct{ idempotency.Store }

func (crashedOwner) Heartbeat(context.Context, idempotency.Key, uint64, time.Duration) error {
	return nil
}

func (crashedOwner) Complete(context.Context, idempotency.Key, uint64, idempotency.Response, time.Duration) error {
	return nil
}

func (crashedOwner) Release(context.Context, idempotency.Key, uint64) error { return nil }

func (crashedOwner) Forget(context.Context, idempotency.Key, uint64) error { return nil }

func (crashedOwner) Abandon(context.Context, idempotency.Key, uint64) error { return nil }

// An operation abandoned before it reached the gateway: the recovery hook
// finds no charge under its downstream key and releases the record, so the
// client's retry runs the handler, which charges once.
//
// The dead owner is this test process rather than a killed instance, which
// could only be killed before its gateway call by luck: the middleware over
// crashedOwner claims the record exactly as an instance would (same scope,
// key and fingerprint), runs a handler that does nothing, and never settles.
func TestRecoveryRunsUnchargedOperation(t *testing.T) {
	t.Parallel()
	rs := testserver.StartRedis(t)
	b := start(t, "-redis", rs.Addr, "-lease", "500ms")

	store, err := idempotency.NewRedisStore(rs.Client(), idempotency.RedisOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	guard := idempotency.New(crashedOwner{store}, idempotency.Options{Lease: 500 * time.Millisecond})
	accepted := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusAccepted) })
	dead := httptest.NewServer(guard.Middleware(idempotency.MiddlewareOptions{
		Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil }})(accepted))
	t.Cleanup(dead.Close)
	r, err := postCharge(dead.URL, "uncharged", "", chargeBody)
	require.NoError(t, err)
	require.Equal(t, http.StatusAccepted, r.status, "%s", r)
	awaitAbandoned(t, store, "uncharged")

	r, err = postCharge(b.url, "uncharged", "", chargeBody)
	require.NoError(t, err)
	made := gatewayCharges(t, rs)
	require.Len(t, made, 1)
	requireCreated(t, r, made[0], false)
	assert.Equal(t, gatewayStats{Calls: 1, Charges: 1}, getJSON[gatewayStats](t, b.url+"/v1/gateway"))
	assert.Equal(t, made, getJSON[[]charge](t, b.url+"/v1/charges"))
	b.logged(t, "never charged")

	again, err := postCharge(b.url, "uncharged", "", chargeBody)
	require.NoError(t, err)
	requireReplayOf(t, r, again)
}

// awaitAbandoned waits until key's record is the one abandoned record.
func awaitAbandoned(t *testing.T, store idempotency.Store, key string) {
	t.Helper()
	require.Eventually(t, func() bool {
		list, err := store.ListAbandoned(t.Context(), 10)
		return err == nil && len(list) == 1 && list[0].Key == idempotency.Key{Scope: testAccount, Name: key}
	}, 5*time.Second, 20*time.Millisecond, "%s's record was never abandoned", key)
}

// When the gateway cannot say what became of an abandoned charge, the
// recovery hook neither charges nor answers: the client gets 409 with
// Retry-After, nothing is recorded, and the record stays abandoned until a
// retry finds the gateway answering again.
func TestRecoveryWithoutAnAnswerWaits(t *testing.T) {
	t.Parallel()
	rs := testserver.StartRedis(t)
	a := start(t, "-redis", rs.Addr, "-work", "2s", "-lease", "500ms")
	b := start(t, "-redis", rs.Addr, "-lease", "500ms")
	killAfterCharging(t, a, "unknown")
	made := gatewayCharges(t, rs)
	require.Len(t, made, 1)

	// The gateway's lookups fail: its charges are moved away, and a value
	// HGET refuses (WRONGTYPE) stands in their place.
	ctx, c := t.Context(), rs.Client()
	require.NoError(t, c.Rename(ctx, gatewayChargesKey, gatewayChargesKey+":away").Err())
	require.NoError(t, c.Set(ctx, gatewayChargesKey, "unreachable", 0).Err())
	store, err := idempotency.NewRedisStore(c, idempotency.RedisOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	awaitAbandoned(t, store, "unknown")

	r, err := postCharge(b.url, "unknown", "", amountBody(100))
	require.NoError(t, err)
	assert.Equal(t, idempotency.ProblemTypes+"in-flight", requireProblem(t, r, http.StatusConflict))
	assert.Equal(t, "1", r.header.Get("Retry-After"))
	b.logged(t, `recover: idem_\S+: gateway: WRONGTYPE .*; left abandoned`)
	requireLedgerEmpty(t, rs)
	// At once, not after a lease: the hook gave the record up unsettled.
	list, err := store.ListAbandoned(ctx, 10)
	require.NoError(t, err)
	require.Len(t, list, 1)
	assert.Equal(t, idempotency.Key{Scope: testAccount, Name: "unknown"}, list[0].Key)

	require.NoError(t, c.Rename(ctx, gatewayChargesKey+":away", gatewayChargesKey).Err())
	r, err = postCharge(b.url, "unknown", "", amountBody(100))
	require.NoError(t, err)
	requireCreated(t, r, made[0], true)
	assert.Equal(t, gatewayStats{Calls: 1, Charges: 1}, getJSON[gatewayStats](t, b.url+"/v1/gateway"))
	assert.Equal(t, made, getJSON[[]charge](t, b.url+"/v1/charges"))
}

// An owner stopped past its lease is taken over (the recovery hook finds its
// charge at the gateway); when it continues, its outcome is refused (fenced
// off), and everyone sees the takeover's answer.
func TestStalledOwnerIsFencedOff(t *testing.T) {
	t.Parallel()
	rs := testserver.StartRedis(t)
	a := start(t, "-redis", rs.Addr, "-work", "1500ms", "-lease", "500ms")
	b := start(t, "-redis", rs.Addr, "-lease", "500ms")

	orig := inBackground(func() (reply, error) { return postCharge(a.url, "stall", "", chargeBody) })
	awaitGatewayCharges(t, b.url, 1)
	a.signal(t, syscall.SIGSTOP)
	r := retryUntilCreated(t, b.url, "stall", chargeBody)
	c := chargeOf(t, r)
	assert.True(t, r.replayed(), "the takeover ran the handler instead of recovering")
	a.signal(t, syscall.SIGCONT)

	var stale result
	select {
	case stale = <-orig:
	case <-time.After(20 * time.Second):
		t.Fatal("the stalled owner never answered after SIGCONT")
	}
	require.NoError(t, stale.err)
	assert.Equal(t, idempotency.ProblemTypes+"outcome-not-recorded",
		requireProblem(t, stale.reply, http.StatusServiceUnavailable))

	for _, in := range []*instance{a, b} {
		again, err := postCharge(in.url, "stall", "", chargeBody)
		require.NoError(t, err)
		requireReplayOf(t, r, again)
	}
	assert.Equal(t, gatewayStats{Calls: 1, Charges: 1}, getJSON[gatewayStats](t, b.url+"/v1/gateway"))
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
	awaitGatewayCharges(t, b.url, 1)
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
