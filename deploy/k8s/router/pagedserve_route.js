// The routing key of a request, for `hash $pagedserve_route_key consistent` (prefix affinity).
//
// Every turn of a conversation resends its whole history, so it must reach the replica whose
// prefix cache already holds that history. The key names the conversation, from the first of:
//   1. the session header ($pagedserve_session_header, X-Session-ID by default), if the client
//      sends one;
//   2. the request's `user` field;
//   3. the start of the conversation, which every later turn repeats unchanged: the system
//      prompt and the first user message for /v1/chat/completions, the first
//      $pagedserve_prompt_prefix_chars characters of the prompt for /v1/completions.
// Anything else (GET /v1/models, a body that is not JSON) gets $request_id: spread at random.
//
// Written for njs 0.7 (Debian 12's libnginx-mod-http-js): `var`, no optional chaining.
// Needs the request body in memory: client_body_buffer_size >= client_max_body_size.

function text(content) {
    if (typeof content === 'string') {
        return content;
    }
    if (!Array.isArray(content)) {
        return '';
    }
    var parts = [];
    for (var i = 0; i < content.length; i++) {
        if (content[i] && content[i].type === 'text') {
            parts.push(content[i].text);
        }
    }
    return parts.join('\n');
}

function chatStart(messages, limit) {
    var system = '';
    for (var i = 0; i < messages.length; i++) {
        var m = messages[i] || {};
        if (m.role === 'system' || m.role === 'developer') {
            system += text(m.content);
        } else if (m.role === 'user') {
            return 'chat:' + system.slice(0, limit) + '\u0000' + text(m.content).slice(0, limit);
        }
    }
    return 'chat:' + system.slice(0, limit);
}

function promptStart(prompt, limit) {
    if (Array.isArray(prompt)) {
        prompt = prompt.length && Array.isArray(prompt[0]) ? prompt[0] : prompt;
        return 'ids:' + prompt.slice(0, limit).join(',');
    }
    return 'prompt:' + String(prompt).slice(0, limit);
}

function key(r) {
    var header = r.variables.pagedserve_session_header;
    var session = header ? r.headersIn[header] : undefined;
    if (session) {
        return 'session:' + session;
    }
    var body;
    try {
        body = JSON.parse(r.requestText);
    } catch (e) {
        return r.variables.request_id;
    }
    if (!body || typeof body !== 'object') {
        return r.variables.request_id;
    }
    if (typeof body.user === 'string' && body.user) {
        return 'user:' + body.user;
    }
    var limit = Number(r.variables.pagedserve_prompt_prefix_chars) || 256;
    if (Array.isArray(body.messages) && body.messages.length) {
        return chatStart(body.messages, limit);
    }
    if (body.prompt !== undefined && body.prompt !== null) {
        return promptStart(body.prompt, limit);
    }
    return r.variables.request_id;
}

export default { key };
