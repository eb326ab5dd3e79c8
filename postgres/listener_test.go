package postgres_test

import (
	"context"
	"net"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
)

// Subscribe promises a wake-up for every settle that follows a watching
// claim. The listening connection can go silent while the rest of the
// network works (a dropped NAT entry or load-balancer flow; here, a proxy in
// front of that one connection swallows every byte): the Store must notice,
// reconnect and wake its subscribers, as the Redis hub does with its pings,
// not keep confirming subscriptions on a connection that delivers nothing
// until TCP keepalive gives up on it many minutes later.
func TestListenerNoticesSilentConnection(t *testing.T) {
	pg := testserver.StartPostgres(t)
	u, err := url.Parse(pg.DSN)
	require.NoError(t, err)
	p := faultproxy.Start(t, u.Host)
	cfg, err := pgxpool.ParseConfig(pg.DSN)
	require.NoError(t, err)
	var viaProxy atomic.Bool
	viaProxy.Store(true)
	var d net.Dialer
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if viaProxy.Load() {
			addr = p.Addr()
		}
		return d.DialContext(ctx, network, addr)
	}
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	s := postgres.New(pool, postgres.Options{})
	t.Cleanup(s.Close)
	ctx := t.Context()

	// The first Subscribe makes the listening connection, the only one
	// through the proxy; every later connection goes direct.
	first, err := s.Subscribe(ctx, key("first"))
	require.NoError(t, err)
	defer first.Close()
	viaProxy.Store(false)
	require.NoError(t, s.Migrate(ctx))

	p.Partition()
	req := request("pay", longLease)
	owner := claim(t, s, req)
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	sub, err := s.Subscribe(sctx, req.Key)
	require.NoError(t, err)
	defer sub.Close()
	waiter := req
	waiter.OperationID, waiter.Watch = "op_waiter", true
	require.Equal(t, idempotency.InFlight, claim(t, s, waiter).State)
	require.NoError(t, s.Complete(ctx, req.Key, owner.Token, okResponse, longRetention))

	select {
	case <-sub.C():
	case <-time.After(15 * time.Second):
		t.Fatal("the waiter was not woken within 15s of the completion: the listening connection went silent unnoticed")
	}
	require.Equal(t, idempotency.Completed, claim(t, s, waiter).State)
}

// An application may build its pool with pgconn's
// CancelRequestContextWatcherHandler, so that a query whose context ends is
// cancelled on the server. The listener's silence timer must not go through
// it: an idle listening connection would send the server a cancel request,
// on a connection of its own, every listenPing (a postmaster fork each, a
// client connection on a PgBouncer), which the server ignores for an idle
// backend, and hold the wait until the handler's DeadlineDelay besides.
func TestListenerSilenceSendsNoCancelRequests(t *testing.T) {
	pg := testserver.StartPostgres(t)
	cfg, err := pgxpool.ParseConfig(pg.DSN)
	require.NoError(t, err)
	var dials atomic.Int32
	var d net.Dialer
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return d.DialContext(ctx, network, addr)
	}
	cfg.ConnConfig.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.CancelRequestContextWatcherHandler{Conn: c, DeadlineDelay: time.Second}
	}
	cfg.MinConns = 0
	s, _ := migratedStore(t, cfg)

	sub, err := s.Subscribe(t.Context(), key("idle"))
	require.NoError(t, err)
	defer sub.Close()
	before := dials.Load()
	time.Sleep(8 * time.Second) // more than two listenPings of silence
	assert.Zero(t, dials.Load()-before, "connections dialled while the listener sat idle (cancel requests)")

	// The listener still delivers.
	req := request("after-idle", longLease)
	owner := claim(t, s, req)
	woken, err := s.Subscribe(t.Context(), req.Key)
	require.NoError(t, err)
	defer woken.Close()
	waiter := req
	waiter.OperationID, waiter.Watch = "op_waiter", true
	require.Equal(t, idempotency.InFlight, claim(t, s, waiter).State)
	require.NoError(t, s.Complete(t.Context(), req.Key, owner.Token, okResponse, longRetention))
	select {
	case <-woken.C():
	case <-time.After(5 * time.Second):
		t.Fatal("no wake-up after the idle period")
	}
}
