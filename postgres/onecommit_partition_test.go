package postgres_test

import (
	"context"
	"net/http"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An owner of the one-commit mode whose link to PostgreSQL goes silent in
// the middle of its operation (a partition: no FIN, no RST, nothing
// answers), its business write made and its transaction open. Nothing on
// the client's side can end that transaction: the server must, by the
// lease (the transaction's idle_in_transaction_session_timeout), or the
// key's row stays locked, and every duplicate waits, for as long as the
// server keeps a dead connection (hours of TCP keepalive). So:
//
//   - the server ends the owner's backend within about the lease;
//   - a duplicate on a sound link, same key and request, waiting on the
//     row, becomes the owner then and runs the operation once, within the
//     lease and a margin of the partition;
//   - the old owner's Do fails (its commit, sent into the partition, is
//     bounded by the lease: ErrUnavailable), within a bound;
//   - the business row exists once, the duplicate's, and a replay through
//     either Guard (the old owner's once the link heals) answers the
//     duplicate's response.
func TestOneCommitPartitionedOwner(t *testing.T) {
	const (
		lease = 400 * time.Millisecond
		// margin covers a loaded machine: the server checks its timeout
		// only as its scheduler lets it, and the duplicate's claim and
		// commit are round trips of their own. Without the server's
		// timeout, nothing would end the owner's transaction for hours.
		margin = 5 * time.Second
		// The old owner's commit is bounded by max(lease, 1s), its
		// rollback by 1s more; the rest is slack.
		ownerBound = 10 * time.Second
	)
	pg := testserver.StartPostgres(t)
	f := &fixture{pool: ocPool(t, pg.DSN)}
	s, o := f.store(t)
	table := charges(t, f, o)

	u, err := url.Parse(pg.DSN)
	require.NoError(t, err)
	proxy := faultproxy.Start(t, u.Host)
	u.Host = proxy.Addr()
	proxied, err := pgxpool.New(t.Context(), u.String())
	require.NoError(t, err)
	t.Cleanup(proxied.Close)
	ownerStore := postgres.New(proxied, o)
	t.Cleanup(ownerStore.Close)

	opts := idempotency.Options{Retention: longRetention, Lease: lease, WaitTimeout: time.Minute}
	owner := idempotency.New(ownerStore.OneCommit(), opts)
	dup := idempotency.New(s.OneCommit(), opts)
	k, req := key("partitioned"), fp("partitioned")

	// A first operation through the proxy, so that the owner's connection
	// has prepared the completion's statement, as a pool's connections
	// have: the owner's commit is then sent whole into the partition,
	// rather than stuck in preparing it.
	var warmRuns atomic.Int64
	warm, err := owner.Do(t.Context(), key("warm"), fp("warm"), chargeOp(table, &warmRuns))
	require.NoError(t, err)

	// The owner's operation: the business write, then the backend's pid,
	// for the test to watch, then it waits for the test.
	var ownerRuns, dupRuns atomic.Int64
	charged, unblock := make(chan int32, 1), make(chan struct{})
	ownerDone := make(chan error, 1)
	go func() {
		_, err := owner.Do(context.Background(), k, req, func(ctx context.Context) (idempotency.Response, error) {
			resp, err := chargeOp(table, &ownerRuns)(ctx)
			if err != nil {
				return resp, err
			}
			tx, _ := postgres.TxFromContext(ctx)
			var pid int32
			if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
				return resp, err
			}
			charged <- pid
			<-unblock
			return resp, nil
		})
		ownerDone <- err
	}()
	var pid int32
	select {
	case pid = <-charged:
	case err := <-ownerDone:
		t.Fatalf("the owner ended before its business write: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("the owner's operation did not run")
	}

	proxy.Partition()
	partitioned := time.Now()
	// The owner's operation goes on, and asks to commit into the partition.
	close(unblock)
	unblocked := time.Now()

	type answer struct {
		res idempotency.Result
		err error
		at  time.Duration // since the partition
	}
	dupDone := make(chan answer, 1)
	go func() {
		res, err := dup.Do(context.Background(), k, req, chargeOp(table, &dupRuns))
		dupDone <- answer{res, err, time.Since(partitioned)}
	}()

	// The server ends the owner's backend: its pid leaves pg_stat_activity.
	require.Eventually(t, func() bool {
		var n int
		err := f.pool.QueryRow(t.Context(), "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid).Scan(&n)
		return err == nil && n == 0
	}, lease+margin, 20*time.Millisecond, "the server did not end the partitioned owner's backend within the lease and %v", margin)
	t.Logf("the server ended the owner's backend %v after the partition (lease %v)", time.Since(partitioned), lease)

	var d answer
	select {
	case d = <-dupDone:
	case <-time.After(lease + margin):
		t.Fatalf("the duplicate did not end within the lease and %v of the partition: the owner's transaction still holds the key", margin)
	}
	require.NoError(t, d.err)
	assert.False(t, d.res.Replayed, "the duplicate became the owner")
	assert.Equal(t, d.res.OperationID, string(d.res.Response.Body))
	assert.Equal(t, int64(1), dupRuns.Load(), "the duplicate ran the operation once")
	t.Logf("the duplicate became the owner and committed %v after the partition", d.at)

	select {
	case err := <-ownerDone:
		require.Error(t, err, "the partitioned owner's Do succeeded")
		assert.ErrorIs(t, err, idempotency.ErrUnavailable, "its commit cannot have been confirmed")
		t.Logf("the old owner's Do failed %v after its operation returned: %v", time.Since(unblocked), err)
	case <-time.After(ownerBound):
		t.Fatalf("the partitioned owner's Do did not return within %v of its operation's return", ownerBound)
	}
	assert.Equal(t, int64(1), ownerRuns.Load())

	// One business row of the key, the duplicate's: the owner's rolled
	// back with its transaction, on the server, without its client.
	var ids []string
	require.NoError(t, f.pool.QueryRow(t.Context(), "SELECT coalesce(array_agg(operation_id), '{}') FROM "+table).Scan(&ids))
	assert.ElementsMatch(t, []string{warm.OperationID, d.res.OperationID}, ids)
	rec, err := s.Inspect(t.Context(), k)
	require.NoError(t, err)
	assert.Equal(t, idempotency.RecordCompleted, rec.State)
	assert.Equal(t, d.res.OperationID, rec.OperationID)

	replay, err := dup.Do(t.Context(), k, req, chargeOp(table, &dupRuns))
	require.NoError(t, err)
	assert.True(t, replay.Replayed)
	assert.Equal(t, d.res.OperationID, replay.OperationID)
	assert.Equal(t, d.res.Response.Body, replay.Response.Body)

	// Once the link heals, the old owner's Guard replays the duplicate's
	// answer too. Its pool may first hand out a connection the partition
	// broke; the answer that matters is the first success.
	proxy.Heal()
	var healed idempotency.Result
	for deadline := time.Now().Add(20 * time.Second); ; {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		healed, err = owner.Do(ctx, k, req, chargeOp(table, &ownerRuns))
		cancel()
		if err == nil {
			break
		}
		require.ErrorIs(t, err, idempotency.ErrUnavailable, "a replay after the heal")
		require.True(t, time.Now().Before(deadline), "no replay through the healed link: %v", err)
		time.Sleep(50 * time.Millisecond)
	}
	assert.True(t, healed.Replayed)
	assert.Equal(t, d.res.OperationID, healed.OperationID)
	assert.Equal(t, d.res.Response.Body, healed.Response.Body)
	assert.Equal(t, http.StatusCreated, healed.Response.Status)
	assert.Equal(t, int64(1), ownerRuns.Load(), "the old owner's replays ran nothing")
	assert.Equal(t, int64(1), dupRuns.Load())
	assert.Equal(t, 2, count(t, f, table), "the key's row and the first operation's")
}
