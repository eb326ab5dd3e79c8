package postgres_test

import (
	"context"
	"net"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testserver"
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
