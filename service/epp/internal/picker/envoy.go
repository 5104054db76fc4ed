package picker

import (
	"encoding/json"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// The endpoint picker protocol's names (Gateway API inference extension).
const (
	DestinationHeader   = "x-gateway-destination-endpoint"
	DestinationMetadata = "envoy.lb" // dynamic metadata namespace of the destination
	SubsetNamespace     = "envoy.lb.subset_hint"
	SubsetKey           = "x-gateway-destination-endpoint-subset"
	RequestIDHeader     = "x-request-id"
)

// headerValue returns the value of the header named name (lower case, as Envoy sends them).
// Envoy sends values in raw_value; value is read too for older proxies.
func headerValue(headers *extprocv3.HttpHeaders, name string) string {
	for _, h := range headers.GetHeaders().GetHeaders() {
		if strings.EqualFold(h.GetKey(), name) {
			if raw := h.GetRawValue(); len(raw) > 0 {
				return string(raw)
			}
			return h.GetValue()
		}
	}
	return ""
}

// subsetHint returns the proxy's candidate addresses from the request's metadata, and whether
// there was a hint at all (an empty hint means no endpoint is eligible, not "any"). The value
// is a list of "host:port" strings; a comma-separated string is accepted too.
func subsetHint(md *corev3.Metadata) (addresses []string, present bool) {
	ns, ok := md.GetFilterMetadata()[SubsetNamespace]
	if !ok {
		return nil, false
	}
	value, ok := ns.GetFields()[SubsetKey]
	if !ok {
		return nil, false
	}
	switch v := value.GetKind().(type) {
	case *structpb.Value_ListValue:
		for _, item := range v.ListValue.GetValues() {
			addresses = appendAddresses(addresses, item.GetStringValue())
		}
	case *structpb.Value_StringValue:
		addresses = appendAddresses(addresses, v.StringValue)
	}
	return addresses, true
}

func appendAddresses(out []string, list string) []string {
	for _, a := range strings.Split(list, ",") {
		if a = strings.TrimSpace(a); a != "" {
			out = append(out, a)
		}
	}
	return out
}

// destinationMutation sets the destination header, and x-request-id when the picker made the
// id up (so that the engine's logs carry the id kvrouterd knows the request by).
func destinationMutation(address, generatedID string) *extprocv3.HeaderMutation {
	m := &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{setHeader(DestinationHeader, address)}}
	if generatedID != "" {
		m.SetHeaders = append(m.SetHeaders, setHeader(RequestIDHeader, generatedID))
	}
	return m
}

func setHeader(key, value string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{
		Header:       &corev3.HeaderValue{Key: key, RawValue: []byte(value)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
	}
}

// destinationMetadata is {"envoy.lb": {"x-gateway-destination-endpoint": address}}: Envoy
// emits each top-level key as a dynamic metadata namespace.
func destinationMetadata(address string) *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		DestinationMetadata: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			DestinationHeader: structpb.NewStringValue(address),
		}}),
	}}
}

func requestHeadersContinue() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{},
	}}
}

func responseHeadersContinue() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{},
	}}
}

// bodyContinue answers a request or response body chunk without changing it. In full-duplex
// mode Envoy forwards only what the processor sends back, so the chunk is echoed then.
func bodyContinue(response bool, chunk *extprocv3.HttpBody, duplex bool) *extprocv3.ProcessingResponse {
	common := &extprocv3.CommonResponse{}
	if duplex {
		common.BodyMutation = streamedBody(chunk.GetBody(), chunk.GetEndOfStream())
	}
	if response {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
			ResponseBody: &extprocv3.BodyResponse{Response: common},
		}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: &extprocv3.BodyResponse{Response: common},
	}}
}

func streamedBody(body []byte, endOfStream bool) *extprocv3.BodyMutation {
	return &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
		StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body, EndOfStream: endOfStream},
	}}
}

func trailersContinue(response bool) *extprocv3.ProcessingResponse {
	if response {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
			ResponseTrailers: &extprocv3.TrailersResponse{},
		}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
		RequestTrailers: &extprocv3.TrailersResponse{},
	}}
}

// immediate ends the HTTP request with status and a JSON error body in the shape of
// kvrouterd's own errors.
func immediate(status int, message string) *extprocv3.ProcessingResponse {
	body, _ := json.Marshal(map[string]any{"error": map[string]any{"message": message}})
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{
			Status: &typev3.HttpStatus{Code: typev3.StatusCode(status)},
			Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				setHeader("content-type", "application/json"),
			}},
			Body:    append(body, '\n'),
			Details: "kvrouter_epp_" + strings.ReplaceAll(strings.ToLower(statusText(status)), " ", "_"),
		},
	}}
}

func statusText(status int) string {
	switch status {
	case 400:
		return "bad request"
	case 413:
		return "body too large"
	case 429:
		return "shed"
	case 504:
		return "route timeout"
	default:
		return "no endpoint"
	}
}
