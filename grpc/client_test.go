package idempotencygrpc_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-go/idempotency"
	idempotencygrpc "github.com/idempotency-go/idempotency/grpc"
	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
)

// quick retries at once, a few times: the tests count attempts, not waits.
var quick = idempotency.RetryPolicy{MaxAttempts: 3, BaseDelay: time.Millisecond, MaxDelay: time.Millisecond}

func withClient(o idempotencygrpc.ClientOptions) grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(idempotencygrpc.UnaryClientInterceptor(o))
}

func TestClientKeepsOneKey(t *testing.T) {
	svc := &payments{charge: func(ctx context.Context, run int64, in *structpb.Struct) (*structpb.Struct, error) {
		if run%3 != 0 {
			return nil, status.Error(codes.Unavailable, "gateway down")
		}
		return receipt(ctx, run, in), nil
	}}
	in := serve(t, redisGuards(t, 1, idempotency.Options{})[0], idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc)
	conn := dial(t, in.addr, withClient(idempotencygrpc.ClientOptions{
		Retry:   quick,
		Methods: func(m string) bool { return m == chargeMethod },
	}))

	for _, caller := range [][]string{nil, nil, {"k-caller"}} {
		seen := len(in.seen.Keys())
		_, _, err := charge(t.Context(), conn, amount(4200), caller...)
		require.NoError(t, err)
		attempts := in.seen.Keys()[seen:]
		require.Len(t, attempts, 3, "two released attempts, then the one that ran")
		for _, keys := range attempts {
			assert.Equal(t, attempts[0], keys, "every attempt of a call has its key")
		}
		require.Len(t, attempts[0], 1)
		if caller != nil {
			assert.Equal(t, caller, attempts[0], "the caller's key is kept")
		} else {
			assert.GreaterOrEqual(t, len(attempts[0][0]), 26, "128 random bits in base32")
		}
	}
	keys := in.seen.Keys()
	assert.NotEqual(t, keys[0], keys[3], "each logical call has a key of its own")

	require.NoError(t, conn.Invoke(t.Context(), balanceMethod, amount(0), new(structpb.Struct)))
	assert.Empty(t, in.seen.Keys()[len(keys)], "a method not chosen gets no key")
}

func TestClientRetriesOnlyWhatIsSafe(t *testing.T) {
	for _, c := range []struct {
		code     codes.Code
		attempts int
	}{
		{codes.Unavailable, 3},
		{codes.Aborted, 3},
		{codes.InvalidArgument, 1},
		{codes.FailedPrecondition, 1},
		{codes.ResourceExhausted, 1},
		{codes.Internal, 1},
		{codes.NotFound, 1},
	} {
		t.Run(c.code.String(), func(t *testing.T) {
			svc := &payments{charge: func(context.Context, int64, *structpb.Struct) (*structpb.Struct, error) {
				return nil, status.Error(c.code, "no")
			}}
			in := serve(t, idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{}),
				idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc)
			conn := dial(t, in.addr, withClient(idempotencygrpc.ClientOptions{Retry: quick}))
			_, _, err := charge(t.Context(), conn, amount(4200))
			assert.Equal(t, c.code, status.Code(err))
			assert.Len(t, in.seen.Keys(), c.attempts)
		})
	}
}

func TestClientStopsOnContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	svc := &payments{charge: func(_ context.Context, run int64, _ *structpb.Struct) (*structpb.Struct, error) {
		if run == 3 {
			cancel()
		}
		return nil, status.Error(codes.Unavailable, "gateway down")
	}}
	in := serve(t, idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{}),
		idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc)
	conn := dial(t, in.addr, withClient(idempotencygrpc.ClientOptions{
		Retry: idempotency.RetryPolicy{MaxAttempts: 1000, BaseDelay: time.Millisecond, MaxDelay: time.Millisecond},
	}))
	_, _, err := charge(ctx, conn, amount(4200))
	assert.Equal(t, codes.Canceled, status.Code(err), "%v", err)
	assert.Len(t, in.seen.Keys(), 3, "no attempt after the context ended")
}

func TestClientUnderGRPCRetryPolicy(t *testing.T) {
	svc := &payments{charge: func(ctx context.Context, run int64, in *structpb.Struct) (*structpb.Struct, error) {
		if run == 1 {
			return nil, status.Error(codes.Unavailable, "gateway down")
		}
		return receipt(ctx, run, in), nil
	}}
	in := serve(t, idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{}),
		idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc)
	conn := dial(t, in.addr,
		withClient(idempotencygrpc.ClientOptions{Retry: idempotency.RetryPolicy{MaxAttempts: 1}}),
		grpc.WithDefaultServiceConfig(`{"methodConfig": [{
			"name": [{"service": "payments.v1.Payments"}],
			"retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.001s", "maxBackoff": "0.001s",
				"backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`))
	_, _, err := charge(t.Context(), conn, amount(4200))
	require.NoError(t, err)
	keys := in.seen.Keys()
	require.Len(t, keys, 2, "grpc-go retried once, inside the interceptor's one attempt")
	assert.Equal(t, keys[0], keys[1])
	assert.Len(t, keys[0], 1)
}

// lostReply makes the proxy lose the reply to one call after the server got
// all of it. The proxy resets a connection on the reply to the first chunk
// it reads once armed, but a gRPC client sends a call's headers and its
// message as two writes: so the client holds the message back (its stats
// handler blocks on the OutHeader event) until the server has the headers
// (its stats handler, on InHeader, arms the proxy and lets the client go),
// and the chunk the proxy dooms is the message.
type lostReply struct {
	mu       sync.Mutex
	proxy    *faultproxy.Proxy
	pending  bool          // the next call's reply is to be lost
	released chan struct{} // closed once the proxy is armed for it; nil when not pending
}

// LoseNext makes the next call's reply lost.
func (l *lostReply) LoseNext() {
	l.mu.Lock()
	l.pending, l.released = true, make(chan struct{})
	l.mu.Unlock()
}

func (l *lostReply) HandleRPC(_ context.Context, s stats.RPCStats) {
	switch s := s.(type) {
	case *stats.OutHeader:
		if released := l.hold(s.Client); released != nil {
			select {
			case <-released:
			case <-time.After(hang):
			}
		}
	case *stats.InHeader:
		if !s.Client {
			l.arm()
		}
	}
}

// hold returns what the client's pending call waits for before it sends
// its message, or nil when no call is pending.
func (l *lostReply) hold(client bool) chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !client || !l.pending {
		return nil
	}
	l.pending = false
	return l.released
}

// arm arms the proxy for the message of the call whose headers the server
// just got, and lets the client send it.
func (l *lostReply) arm() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.released != nil {
		l.proxy.ResetOnNextRequest(true)
		close(l.released)
		l.released = nil
	}
}

func (*lostReply) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context   { return ctx }
func (*lostReply) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (*lostReply) HandleConn(context.Context, stats.ConnStats)                       {}

// lostReplyRig is a server on Redis behind a proxy that can lose a reply,
// and a client through it, connected by one call of Balance: nothing of the
// connection's setup (such as the server's acknowledgement of the client's
// settings, which may come late) is left to pass the proxy during a later
// call. Neither side estimates bandwidth, so neither sends anything between
// a call and its reply that the proxy could take for either. Keys()[1:]
// are the calls after that first one.
func lostReplyRig(t *testing.T, svc *payments, dialOpts ...grpc.DialOption) (*instance, *lostReply, *grpc.ClientConn) {
	t.Helper()
	l := &lostReply{}
	in := serve(t, redisGuards(t, 1, idempotency.Options{})[0], idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc,
		grpc.StatsHandler(l), grpc.InitialWindowSize(1<<20), grpc.InitialConnWindowSize(1<<20))
	proxy := faultproxy.Start(t, in.addr)
	l.mu.Lock()
	l.proxy = proxy
	l.mu.Unlock()
	conn := dial(t, proxy.Addr(), append(dialOpts, grpc.WithStatsHandler(l),
		grpc.WithInitialWindowSize(1<<20), grpc.WithInitialConnWindowSize(1<<20))...)
	require.NoError(t, conn.Invoke(t.Context(), balanceMethod, amount(0), new(structpb.Struct)))
	return in, l, conn
}

func TestClientLostReply(t *testing.T) {
	t.Run("nothing lost unless asked", func(t *testing.T) {
		svc := &payments{}
		in, _, conn := lostReplyRig(t, svc)
		_, _, err := charge(t.Context(), conn, amount(4200), "k-plain")
		require.NoError(t, err)
		assert.Len(t, in.seen.Keys()[1:], 1)
	})
	t.Run("the interceptor's retry is replayed", func(t *testing.T) {
		svc := &payments{}
		in, l, conn := lostReplyRig(t, svc, withClient(idempotencygrpc.ClientOptions{Retry: quick}))
		l.LoseNext()
		reply, md, err := charge(t.Context(), conn, amount(4200))
		require.NoError(t, err)
		assert.True(t, replayed(md), "the retry got the stored reply")
		assert.Equal(t, 1.0, reply.GetFields()["run"].GetNumberValue())
		assert.Equal(t, int64(1), svc.runs.Load(), "the handler ran once")
		keys := in.seen.Keys()[1:]
		require.Len(t, keys, 2, "the call reached the server twice")
		assert.Equal(t, keys[0], keys[1], "with one key")
	})
	t.Run("a naive client charges twice", func(t *testing.T) {
		// A client that makes its key per attempt rather than per logical
		// call, and retries the lost reply.
		svc := &payments{}
		in, l, conn := lostReplyRig(t, svc)
		l.LoseNext()
		_, _, err := charge(t.Context(), conn, amount(4200), "k-naive-1")
		require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
		_, _, err = charge(t.Context(), conn, amount(4200), "k-naive-2")
		require.NoError(t, err)
		assert.Len(t, in.seen.Keys()[1:], 2)
		assert.Equal(t, int64(2), svc.runs.Load(), "the handler ran for each attempt")
	})
}
