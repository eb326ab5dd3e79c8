package idempotencygrpc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"time"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/idempotency-go/idempotency"
)

// ServerOptions configures UnaryServerInterceptor. The zero value of every
// field is its documented default.
type ServerOptions struct {
	// Methods reports whether calls of the method with this full name
	// ("/payments.v1.Payments/Charge") are guarded; calls of other methods
	// pass through untouched. Default: every unary method.
	Methods func(fullMethod string) bool
	// RequireKey refuses a guarded call without an idempotency-key with
	// InvalidArgument. Default false: such a call runs unguarded, as a
	// client that never retries would have it.
	RequireKey bool
	// Scope returns the scope of the call's key: the account or tenant it
	// belongs to, so that two tenants never share a record whatever keys
	// their clients choose. An error ends the call: with its own status
	// when it carries one (status.Error), else with InvalidArgument, its
	// text not sent. An empty scope ends it with InvalidArgument too: it
	// would share one scope with every call that names no account.
	// Required: UnaryServerInterceptor panics without it, so that no
	// service shares keys between its tenants by omission; a service with
	// a single tenant says so with SingleTenant, the one Scope whose empty
	// scope is served.
	Scope func(ctx context.Context, fullMethod string) (string, error)
	// Disposition chooses, from the code the handler returned, what
	// becomes of the record. Default DefaultDisposition.
	Disposition func(code codes.Code) idempotency.Disposition
	// RetryAfter is sent in the grpc-retry-pushback-ms trailer with Aborted
	// (the original still in flight) and Unavailable, in whole
	// milliseconds, at least 1. Default 1s.
	RetryAfter time.Duration
}

func (o ServerOptions) withDefaults() ServerOptions {
	if o.Methods == nil {
		o.Methods = func(string) bool { return true }
	}
	if o.Disposition == nil {
		o.Disposition = DefaultDisposition
	}
	if o.RetryAfter <= 0 {
		o.RetryAfter = time.Second
	}
	return o
}

// DefaultDisposition is the server interceptor's default policy, the HTTP
// middleware's (idempotency.DefaultDisposition) carried over to gRPC codes:
// what the server failed at is released for a retry, what the server
// refused before acting is forgotten so that the client may correct the
// call and reuse its key, and answers about the request are kept.
//
//   - Release: Unknown, Internal, Unavailable, DataLoss, Unimplemented (a
//     rolling deploy may not have reached every instance),
//     DeadlineExceeded, ResourceExhausted, Aborted, and Canceled. The
//     handler may have begun acting when it stopped; a released key keeps
//     the operation ID, so the retry's downstream keys are the same.
//   - Forget: InvalidArgument, FailedPrecondition, OutOfRange (the codes
//     that map to HTTP 400), Unauthenticated and PermissionDenied. The
//     handler refused before acting, and the client may fix the request,
//     its credentials or the state it depends on, then retry with the same
//     key; a kept refusal would be replayed to it for the whole retention.
//     A retry after a failed attempt, or an attempt that began a Step, is
//     released instead (see idempotency.Forget).
//   - Keep: OK, NotFound, AlreadyExists: the answer to the request, which
//     every retry must get.
func DefaultDisposition(code codes.Code) idempotency.Disposition {
	switch code {
	case codes.OK, codes.NotFound, codes.AlreadyExists:
		return idempotency.Keep
	case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange,
		codes.Unauthenticated, codes.PermissionDenied:
		return idempotency.Forget
	}
	return idempotency.Release
}

// SingleTenant is the ServerOptions.Scope of a service with one tenant:
// every call's key is in the same scope, "".
func SingleTenant(context.Context, string) (string, error) { return "", nil }

// UnaryServerInterceptor returns an interceptor that runs each guarded call
// carrying an idempotency-key through g.Do, so that its handler runs at most
// once per key and every retry receives the same response message, or the
// same status with its details, wherever it lands. The package
// documentation lists its answers.
//
// The handler's outcome is stored before it is returned; should storing it
// fail, the caller gets Unavailable and not the handler's answer, and its
// retry finds out what was stored. The handler's context is the one Guard.Do
// gives its operation: idempotency.FromContext and DownstreamKey work in
// it, and it ends, with a cause matching idempotency.ErrFenced, when the
// lease ends. It panics when o.Scope is nil.
func UnaryServerInterceptor(g *idempotency.Guard, o ServerOptions) grpc.UnaryServerInterceptor {
	if o.Scope == nil {
		panic("idempotencygrpc: ServerOptions.Scope is nil: name the account a key belongs to, or use SingleTenant")
	}
	o = o.withDefaults()
	ms := max(1, o.RetryAfter.Milliseconds())
	s := &server{g: g, o: o, pushback: metadata.Pairs(pushbackKey, strconv.FormatInt(ms, 10)),
		singleTenant: reflect.ValueOf(o.Scope).Pointer() == reflect.ValueOf(SingleTenant).Pointer()}
	return s.intercept
}

var (
	errKeyMissing  = status.Error(codes.InvalidArgument, "idempotency: idempotency-key metadata required")
	errKeyRepeated = status.Error(codes.InvalidArgument, "idempotency: idempotency-key metadata sent more than once")
	errScope       = status.Error(codes.InvalidArgument, "idempotency: the call does not identify the account its idempotency key belongs to")
)

type server struct {
	g            *idempotency.Guard
	o            ServerOptions
	pushback     metadata.MD
	singleTenant bool // o.Scope is SingleTenant: the empty scope is every call's
}

func (s *server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if !s.o.Methods(info.FullMethod) {
		return handler(ctx, req)
	}
	keys := metadata.ValueFromIncomingContext(ctx, MetadataKey)
	if len(keys) == 0 && !s.o.RequireKey {
		return handler(ctx, req)
	}
	c, err := s.admit(ctx, info.FullMethod, req, keys)
	if err != nil {
		return nil, err
	}
	var resp any   // the handler's own answer, for the call that ran it
	var herr error // and its own error
	res, err := s.g.Do(ctx, c.key, c.fp, func(ctx context.Context) (idempotency.Response, error) {
		resp, herr = handler(ctx, req)
		return s.outcome(ctx, resp, herr)
	})
	switch {
	case err != nil:
		return nil, s.fail(ctx, err)
	case !res.Replayed:
		return resp, herr
	}
	_ = grpc.SetHeader(ctx, metadata.Pairs(MetadataReplayed, "true")) // fails only on a stream already done
	return replay(res.Response, c.reply)
}

// call is what admit learns of a guarded call before the store is asked.
type call struct {
	key   idempotency.Key
	fp    idempotency.Fingerprint
	reply protoreflect.MessageType // the method's output type, for a replay
}

// admit checks everything that can be checked before the store is asked:
// the key, the scope, the request and the method's output type.
func (s *server) admit(ctx context.Context, method string, req any, keys []string) (call, error) {
	switch len(keys) {
	case 0:
		return call{}, errKeyMissing
	case 1:
	default:
		return call{}, errKeyRepeated
	}
	c := call{key: idempotency.Key{Name: keys[0]}}
	if err := c.key.Validate(); err != nil {
		return call{}, status.Error(codes.InvalidArgument, err.Error())
	}
	var err error
	if c.key.Scope, err = s.o.Scope(ctx, method); err != nil {
		if st, ok := status.FromError(err); ok {
			return call{}, st.Err()
		}
		return call{}, errScope
	}
	if c.key.Scope == "" && !s.singleTenant {
		return call{}, errScope
	}
	m, ok := req.(proto.Message)
	if !ok {
		return call{}, status.Errorf(codes.Internal, "idempotencygrpc: the request of %s, a %T, is not a proto.Message", method, req)
	}
	if c.reply, err = outputType(method); err != nil {
		return call{}, status.Errorf(codes.Internal, "idempotencygrpc: %s cannot be replayed: %v", method, err)
	}
	payload, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		return call{}, status.Errorf(codes.Internal, "idempotencygrpc: marshalling the request of %s: %v", method, err)
	}
	c.fp = fingerprint(method, payload)
	return c, nil
}

// fingerprint is the fingerprint of a call of method with the marshalled
// request payload, byte for byte. FingerprintOf canonicalises a payload that
// is a JSON text, and a message's bytes can be one (a single string field
// 34 bytes long starts with '\n' '"'): then two different messages could
// canonicalise alike. Such a payload gets a 0xff before it, which is not
// JSON, so it is hashed byte for byte, and which no message's bytes start
// with (wire type 7 does not exist), so it cannot pass for another message.
// Every other payload is fingerprinted as before.
func fingerprint(method string, payload []byte) idempotency.Fingerprint {
	if json.Valid(payload) {
		payload = append([]byte{0xff}, payload...)
	}
	return idempotency.FingerprintOf(method, payload)
}

// outputType finds the output message type of the method named fullMethod
// ("/pkg.Service/Method") in the global registries, which every instance
// holds alike, so that one that never ran the handler can decode its reply.
func outputType(fullMethod string) (protoreflect.MessageType, error) {
	service, method, ok := strings.Cut(strings.TrimPrefix(fullMethod, "/"), "/")
	if !ok {
		return nil, errors.New("not a full method name")
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(service + "." + method))
	if err != nil {
		return nil, fmt.Errorf("method not in protoregistry.GlobalFiles: %w", err)
	}
	md, ok := d.(protoreflect.MethodDescriptor)
	if !ok {
		return nil, fmt.Errorf("%s is not a method", d.FullName())
	}
	mt, err := protoregistry.GlobalTypes.FindMessageByName(md.Output().FullName())
	if err != nil {
		return nil, fmt.Errorf("output type %s not in protoregistry.GlobalTypes: %w", md.Output().FullName(), err)
	}
	return mt, nil
}

// outcome is the Response stored for the handler's answer, its disposition
// chosen from the answer's code. A response that cannot be stored is an
// error, which releases the key.
func (s *server) outcome(ctx context.Context, resp any, herr error) (idempotency.Response, error) {
	st := handlerStatus(herr)
	idempotency.SetDefaultDisposition(ctx, s.o.Disposition(st.Code()))
	if herr != nil {
		body, err := proto.Marshal(st.Proto())
		if err != nil {
			return idempotency.Response{}, fmt.Errorf("idempotencygrpc: marshalling the handler's status: %w", err)
		}
		return idempotency.Response{Status: int(st.Code()), Body: body}, nil
	}
	m, ok := resp.(proto.Message)
	if !ok {
		return idempotency.Response{}, fmt.Errorf("idempotencygrpc: the handler's response, a %T, is not a proto.Message", resp)
	}
	body, err := proto.Marshal(m)
	if err != nil {
		return idempotency.Response{}, fmt.Errorf("idempotencygrpc: marshalling the handler's response: %w", err)
	}
	return idempotency.Response{Status: int(codes.OK), Body: body}, nil
}

// handlerStatus is the status a client receives for the handler's error,
// converted as grpc-go converts it: a context's error becomes its code.
func handlerStatus(err error) *status.Status {
	if st, ok := status.FromError(err); ok {
		return st
	}
	return status.FromContextError(err)
}

// statusOf is the error of a stored Response: nil for OK, else its status.
func statusOf(r idempotency.Response) error {
	if codes.Code(r.Status) == codes.OK {
		return nil
	}
	var p spb.Status
	if err := proto.Unmarshal(r.Body, &p); err != nil {
		return status.Errorf(codes.Internal, "idempotencygrpc: the stored status is unreadable: %v", err)
	}
	return status.ErrorProto(&p)
}

// replay is the answer a stored Response gives: a new message of the
// method's output type, or its status.
func replay(r idempotency.Response, reply protoreflect.MessageType) (any, error) {
	if err := statusOf(r); err != nil {
		return nil, err
	}
	m := reply.New().Interface()
	if err := proto.Unmarshal(r.Body, m); err != nil {
		return nil, status.Errorf(codes.Internal, "idempotencygrpc: the stored response is unreadable: %v", err)
	}
	return m, nil
}

// fail is the status for an error of Guard.Do. Store failures are described
// without their text, which may name internal hosts.
func (s *server) fail(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
	switch {
	case errors.Is(err, idempotency.ErrInvalidKey):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, idempotency.ErrMismatch):
		return status.Error(codes.FailedPrecondition,
			"idempotency: this idempotency-key was used before with a different request")
	case errors.Is(err, idempotency.ErrInFlight):
		// Before ErrUnavailable: a store failure while waiting for the
		// original is still a call whose original is known to run.
		_ = grpc.SetTrailer(ctx, s.pushback)
		return status.Error(codes.Aborted,
			"idempotency: a call with this idempotency-key is still in progress; retry later with the same key")
	case errors.Is(err, idempotency.ErrFenced), errors.Is(err, idempotency.ErrUnavailable):
		_ = grpc.SetTrailer(ctx, s.pushback)
		return status.Error(codes.Unavailable,
			"idempotency: the outcome of this call could not be looked up or recorded; retry later with the same key")
	}
	return status.Error(codes.Internal, err.Error())
}
