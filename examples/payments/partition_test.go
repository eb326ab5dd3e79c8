package main

// Issue 10: the payments example under a partition of one instance. Three
// instances share one store; A reaches it through a fault proxy, which cuts
// A off, for longer than the lease, while A has charges in flight. B and C
// take A's records over; when the link heals, A must not make a charge's
// gateway call behind the takeover's back.

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

const (
	// Against the instances' -lease 1s: A's records run out while it is
	// cut off, and are taken over by B, C or their sweepers.
	partitionFor = 3 * time.Second
	// Longer than the partition: a request cut off with A is still open
	// when the link heals, so A's handler is not cancelled by its client
	// hanging up, which would hide an owner that carries on after losing
	// its record. A request A leaves unanswered after the heal too goes
	// elsewhere.
	clientTimeout = 4 * time.Second
	// Each way, on A's link to the store.
	linkLatency = 25 * time.Millisecond
	// New charges keep starting this long after the heal, so that A is
	// seen serving again.
	loadAfterHeal    = 2 * time.Second
	partitionClients = 24
	// A client stops at this many keys even if the load runs long.
	keysPerClient = 60
	// A key without a 201 by then is a failure, not a reason to wait on.
	keyDeadline = 40 * time.Second
)

func TestPartitionedInstanceOnRedis(t *testing.T) {
	t.Parallel()
	rs := testserver.StartRedis(t)
	p := faultproxy.Start(t, rs.Addr)
	answered := requireOneCallPerCharge(t, p, "-redis", p.Addr(), rs.Addr)
	assert.Equal(t, answered, gatewayCharges(t, rs), "the gateway's charges are not those the clients were answered")
}

func TestPartitionedInstanceOnPostgres(t *testing.T) {
	t.Parallel()
	pg := testserver.StartPostgres(t)
	p := faultproxy.Start(t, fmt.Sprintf("127.0.0.1:%d", pg.Port))
	u, err := url.Parse(pg.DSN)
	require.NoError(t, err)
	u.Host = p.Addr()
	answered := requireOneCallPerCharge(t, p, "-postgres", u.String(), pg.DSN)
	assert.Equal(t, answered, postgresGatewayCharges(t, pg.DSN), "the gateway's charges are not those the clients were answered")
}

// requireOneCallPerCharge runs the partition on one service of three
// instances, A reaching the store (flag) at viaProxy, through p, and B and C
// at direct. It checks what the clients were answered, the ledger and the
// gateway's counts, and returns the charges answered, ordered by id, for the
// caller to compare with the gateway's own list.
func requireOneCallPerCharge(t *testing.T, p *faultproxy.Proxy, flag, viaProxy, direct string) []charge {
	args := []string{"-lease", "1s", "-wait", "10s", "-work", "300ms", "-sweep", "250ms"}
	a := start(t, append([]string{flag, viaProxy}, args...)...)
	b := start(t, append([]string{flag, direct}, args...)...)
	c := start(t, append([]string{flag, direct}, args...)...)
	require.NotZero(t, p.Conns(), "A does not reach the store through the proxy")
	// A slow link puts some of A's owners between their claim and their
	// gateway call when it is cut: owners a takeover finds uncharged, and
	// whose call must then never arrive.
	p.SetLatency(linkLatency)

	l := newLoad(t, a, b, c)
	stop := make(chan struct{})
	done := l.run(stop)
	// Whatever fails below, the clients stop starting keys; their current
	// keys end by keyDeadline, or at once when the test's context ends.
	stopOnce := sync.OnceFunc(func() { close(stop) })
	defer stopOnce()

	// Past the load's start, when A's requests are still claiming, to a
	// steady state, where most of them are inside the gateway's latency.
	awaitGatewayCharges(t, b.url, 3*partitionClients)
	require.Eventually(t, func() bool { return l.onA.Load() >= partitionClients/6 }, 15*time.Second, 5*time.Millisecond,
		"A never had %d requests in flight", partitionClients/6)
	cutOff := l.onA.Load()
	p.Partition()
	l.partitioned.Store(true)
	time.Sleep(partitionFor)
	p.Heal()
	// The link comes back whole, so that the audit's replays do not pay
	// its latency.
	p.SetLatency(0)
	l.healed.Store(true)
	time.Sleep(loadAfterHeal)
	stopOnce()
	outcomes := <-done

	n := len(outcomes)
	var failed []string
	answered := make([]charge, 0, n)
	ids := map[string]string{}
	for _, o := range outcomes {
		if o.err != "" {
			failed = append(failed, o.key+": "+o.err)
			continue
		}
		ch := chargeOf(t, o.created)
		assert.Equal(t, int64(o.amount), ch.Amount, "%s was answered another key's charge", o.key)
		if other, dup := ids[ch.ID]; dup {
			t.Errorf("%s and %s were answered the same charge %s", other, o.key, ch.ID)
		}
		ids[ch.ID] = o.key
		answered = append(answered, ch)
	}
	require.Empty(t, failed, "keys without a 201")
	slices.SortFunc(answered, func(x, y charge) int { return strings.Compare(x.ID, y.ID) })

	assert.Equal(t, answered, awaitLedger(t, b.url, n), "the ledger is not one entry per key")
	for _, o := range outcomes {
		for _, in := range l.instances {
			again, err := postCharge(in.url, o.key, "", amountBody(o.amount))
			require.NoError(t, err)
			requireReplayOf(t, o.created, again)
		}
	}
	// Read last, seconds after the heal: a gateway call A sent late has
	// landed by now.
	stats := getJSON[gatewayStats](t, b.url+"/v1/gateway")
	assert.Equal(t, int64(n), stats.Charges, "gateway charges for %d keys", n)
	assert.Equal(t, stats.Charges, stats.Calls,
		"more gateway calls than charges: an owner cut off from the store called the gateway for a record taken over")
	assert.NotZero(t, l.createdByAHealed.Load(), "A answered no charge once the partition healed")

	logs := a.stderr() + b.stderr() + c.stderr()
	t.Logf("%d charges by %d clients; %d requests in flight on A when it was cut off for %v, %d keys started during the partition",
		n, partitionClients, cutOff, partitionFor, l.startedCutOff.Load())
	t.Logf("%d retries: %d requests unanswered (timeout %v) or failed, %d answered 409, %d answered 503",
		l.sent.Load()-int64(n), l.unanswered.Load(), clientTimeout, l.conflicts.Load(), l.unavailable.Load())
	t.Logf("gateway: %d calls, %d charges; recoveries: %d had charged, %d never charged; sweeps settled %d",
		stats.Calls, stats.Charges, strings.Count(logs, "had charged"), strings.Count(logs, "never charged"),
		settledBy(a)+settledBy(b)+settledBy(c))
	took := make([]time.Duration, n)
	for i, o := range outcomes {
		took[i] = o.took
	}
	slices.Sort(took)
	t.Logf("time to a client's 201: p50 %v, p99 %v, max %v", took[n/2], took[(n*99+99)/100-1], took[n-1])
	return answered
}

// load is the clients of one run: each charges key after key, every key
// under its own amount, and retries a key until it is answered 201.
type load struct {
	ctx       context.Context // the test's: ends every request when the test does
	http      *http.Client
	instances []*instance

	partitioned, healed atomic.Bool
	keys                atomic.Int64
	onA                 atomic.Int32 // requests outstanding on A, instances[0]
	createdByAHealed    atomic.Int32 // 201s from A after the heal
	sent                atomic.Int64
	unanswered          atomic.Int64
	conflicts           atomic.Int64
	unavailable         atomic.Int64
	startedCutOff       atomic.Int64
}

// outcome is what became of one key.
type outcome struct {
	key     string
	amount  int
	created reply         // the 201
	took    time.Duration // from the key's first request to its 201
	err     string        // why there is no 201
}

func newLoad(t *testing.T, instances ...*instance) *load {
	// Idle connections kept for every client, so that the load measures
	// the service rather than TCP handshakes.
	tr := &http.Transport{MaxIdleConnsPerHost: partitionClients}
	t.Cleanup(tr.CloseIdleConnections)
	return &load{ctx: t.Context(), http: &http.Client{Timeout: clientTimeout, Transport: tr}, instances: instances}
}

// run starts the clients; they start no key once stop is closed, and the
// channel delivers every key's outcome once they have all ended.
func (l *load) run(stop <-chan struct{}) <-chan []outcome {
	done := make(chan []outcome, 1)
	var (
		mu  sync.Mutex
		all []outcome
		wg  sync.WaitGroup
	)
	for range partitionClients {
		wg.Go(func() {
			for range keysPerClient {
				select {
				case <-stop:
					return
				default:
				}
				o := l.charge(int(l.keys.Add(1)))
				mu.Lock()
				all = append(all, o)
				mu.Unlock()
			}
		})
	}
	go func() {
		wg.Wait()
		done <- all
	}()
	return done
}

// charge sends key i's charge, first to instance i mod 3, and on 409, 503
// or no answer to the next instance, until it is answered 201.
func (l *load) charge(i int) outcome {
	o := outcome{key: fmt.Sprintf("part-%d", i), amount: 100 + i}
	if l.partitioned.Load() && !l.healed.Load() {
		l.startedCutOff.Add(1)
	}
	began := time.Now()
	backoff := 50 * time.Millisecond
	for in := i; ; in++ {
		in %= len(l.instances)
		if in == 0 {
			l.onA.Add(1)
		}
		r, err := l.post(l.instances[in].url, o.key, amountBody(o.amount))
		if in == 0 {
			l.onA.Add(-1)
		}
		l.sent.Add(1)
		switch {
		case l.ctx.Err() != nil:
			o.err = "the test ended"
			return o
		case err != nil:
			l.unanswered.Add(1)
		case r.status == http.StatusCreated:
			if in == 0 && l.healed.Load() {
				l.createdByAHealed.Add(1)
			}
			o.created, o.took = r, time.Since(began)
			return o
		case r.status == http.StatusConflict:
			l.conflicts.Add(1)
		case r.status == http.StatusServiceUnavailable:
			l.unavailable.Add(1)
		default:
			o.err = fmt.Sprintf("instance %d answered %s", in, r)
			return o
		}
		if time.Since(began) > keyDeadline {
			o.err = fmt.Sprintf("no 201 in %v; last %v %v", keyDeadline, r, err)
			return o
		}
		time.Sleep(backoff)
		backoff = min(2*backoff, 400*time.Millisecond)
	}
}

// post is postCharge by an impatient client: it gives up after
// clientTimeout, as a client of a partitioned instance must to get anywhere.
func (l *load) post(base, key, body string) (reply, error) {
	req, err := http.NewRequestWithContext(l.ctx, http.MethodPost, base+"/v1/charges", strings.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("X-Account-ID", testAccount)
	return roundTrip(l.http, req)
}

// postgresGatewayCharges returns the charges the gateway made, ordered by
// id, read from PostgreSQL rather than through the service under test.
func postgresGatewayCharges(t *testing.T, dsn string) []charge {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	require.NoError(t, err)
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	rows, _ := conn.Query(ctx, `SELECT charge FROM payments_gateway_charges`)
	charges, err := pgx.CollectRows(rows, pgx.RowTo[charge])
	require.NoError(t, err)
	slices.SortFunc(charges, func(x, y charge) int { return strings.Compare(x.ID, y.ID) })
	return charges
}
