// omni-triton web demo: plain JS, no build step. Talks to the OpenAI-compatible
// endpoints of the same origin: /v1/models, /v1/chat/completions (streamed SSE,
// text + optional 24 kHz PCM16 speech), /v1/images/generations.
"use strict";

(() => {
  const SAMPLE_RATE = 24000; // OpenAI's pcm16: 16-bit little-endian mono at 24 kHz
  const $ = (id) => document.getElementById(id);
  const el = {
    model: $("model"), prompt: $("prompt"), send: $("send"), messages: $("messages"),
    speak: $("speak"), imageFile: $("image-file"), audioFile: $("audio-file"),
    status: $("status"), error: $("error"), composer: $("composer"), clear: $("clear"),
    stop: $("stop"), record: $("record"), genImage: $("generate-image"),
    attachments: $("attachments"), voice: $("voice"), temperature: $("temperature"),
    maxTokens: $("max-tokens"), seed: $("seed"), imageSize: $("image-size"),
    imageModel: $("image-model"), empty: $("empty"), voiceMode: $("voice-mode"),
  };

  el.videoFile = $("video-file");

  // The conversation as OpenAI messages (the assistant's turns as text).
  const history = [];
  let busy = false;
  let controller = null;
  let recorded = null; // {dataUrl, blob, name} of a microphone recording

  // --- small helpers ---------------------------------------------------------------

  function setStatus(state, text) {
    el.status.dataset.state = state;
    el.status.textContent = text || state;
  }

  function showError(message) {
    el.error.textContent = message;
    el.error.hidden = false;
  }

  function clearError() {
    el.error.textContent = "";
    el.error.hidden = true;
  }

  function setBusy(on) {
    busy = on;
    el.send.disabled = on;
    el.genImage.disabled = on;
    el.stop.hidden = !on;
  }

  function readAsDataURL(blob) {
    return new Promise((resolve, reject) => {
      const r = new FileReader();
      r.onload = () => resolve(r.result);
      r.onerror = () => reject(r.error || new Error("could not read the file"));
      r.readAsDataURL(blob);
    });
  }

  function base64ToBytes(b64) {
    const bin = atob(b64);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  function audioFormat(file) {
    const ext = (file.name.split(".").pop() || "").toLowerCase();
    if (["wav", "mp3", "flac", "ogg"].includes(ext)) return ext;
    const sub = (file.type.split("/")[1] || "").toLowerCase();
    if (sub.includes("wav")) return "wav";
    if (sub.includes("mpeg") || sub.includes("mp3")) return "mp3";
    if (sub.includes("flac")) return "flac";
    if (sub.includes("ogg")) return "ogg";
    return "wav";
  }

  // An error body from the server: OpenAI's {"error": {"message", ...}}.
  async function errorMessage(response) {
    let text = "";
    try { text = await response.text(); } catch (e) { /* ignore */ }
    try {
      const body = JSON.parse(text);
      if (body && body.error) {
        return typeof body.error === "string" ? body.error : (body.error.message || JSON.stringify(body.error));
      }
      if (body && body.detail) return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    } catch (e) { /* not JSON */ }
    return `HTTP ${response.status} ${response.statusText}${text ? ": " + text.slice(0, 300) : ""}`;
  }

  // --- messages on the page --------------------------------------------------------

  function addMessage(role) {
    if (el.empty) { el.empty.remove(); el.empty = null; }
    const wrap = document.createElement("div");
    wrap.className = `message ${role}`;
    const who = document.createElement("div");
    who.className = "role";
    who.textContent = role === "user" ? "You" : "omni";
    const body = document.createElement("div");
    body.className = "content";
    wrap.append(who, body);
    el.messages.appendChild(wrap);
    return { wrap, body };
  }

  function scrollDown() {
    el.messages.scrollTop = el.messages.scrollHeight;
  }

  // Only the newest element keeps a test-facing id (#reply, #audio-player, #generated-image).
  function takeId(node, id) {
    const old = document.getElementById(id);
    if (old && old !== node) old.removeAttribute("id");
    node.id = id;
  }

  function renderUser(text, image, audio, video) {
    const { wrap, body } = addMessage("user");
    if (text) {
      const p = document.createElement("div");
      p.className = "text";
      p.textContent = text;
      body.appendChild(p);
    }
    if (image) {
      const img = document.createElement("img");
      img.className = "thumb";
      img.src = image.dataUrl;
      img.alt = image.name;
      body.appendChild(img);
    }
    if (audio) {
      const a = document.createElement("audio");
      a.controls = true;
      a.preload = "metadata";
      a.src = URL.createObjectURL(audio.blob); // (Chromium shows no duration for data: audio)
      const name = document.createElement("div");
      name.className = "attachment-name";
      name.textContent = `♪ ${audio.name}`;
      body.append(a, name);
    }
    if (video) {
      const v = document.createElement("video");
      v.className = "thumb";
      v.controls = true;
      v.muted = true;
      v.preload = "metadata";
      v.src = URL.createObjectURL(video.blob);
      const name = document.createElement("div");
      name.className = "attachment-name";
      name.textContent = `▶ ${video.name}`;
      body.append(v, name);
    }
    scrollDown();
    return wrap;
  }

  // --- attachments -----------------------------------------------------------------

  function currentImage() {
    const f = el.imageFile.files && el.imageFile.files[0];
    return f || null;
  }

  function currentAudio() {
    const f = el.audioFile.files && el.audioFile.files[0];
    return f || null;
  }

  function currentVideo() {
    const f = el.videoFile.files && el.videoFile.files[0];
    return f || null;
  }

  function renderAttachments() {
    el.attachments.textContent = "";
    const items = [];
    const img = currentImage();
    if (img) items.push(["image", img.name, () => { el.imageFile.value = ""; }]);
    const aud = currentAudio();
    if (aud) items.push(["audio", aud.name, () => { el.audioFile.value = ""; }]);
    if (recorded) items.push(["recording", recorded.name, () => { recorded = null; }]);
    const vid = currentVideo();
    if (vid) items.push(["video", vid.name, () => { el.videoFile.value = ""; }]);
    for (const [kind, name, drop] of items) {
      const chip = document.createElement("span");
      chip.className = `chip ${kind}`;
      chip.textContent = `${kind}: ${name}`;
      const x = document.createElement("button");
      x.type = "button";
      x.className = "chip-x";
      x.title = "Remove";
      x.textContent = "×";
      x.addEventListener("click", () => { drop(); renderAttachments(); });
      chip.appendChild(x);
      el.attachments.appendChild(chip);
    }
  }

  el.imageFile.addEventListener("change", renderAttachments);
  el.videoFile.addEventListener("change", renderAttachments);
  el.audioFile.addEventListener("change", () => { recorded = null; renderAttachments(); });

  // --- streamed speech: schedule PCM16 chunks back to back, keep them for a WAV ------

  class SpeechPlayer {
    constructor() {
      this.chunks = [];
      this.samples = 0;
      this.ctx = null;
      this.next = 0;
      try {
        const Ctx = window.AudioContext || window.webkitAudioContext;
        if (Ctx) this.ctx = new Ctx();
        if (this.ctx && this.ctx.state === "suspended") this.ctx.resume().catch(() => {});
      } catch (e) {
        this.ctx = null; // no audio output: still build the WAV
      }
    }

    push(b64) {
      const bytes = base64ToBytes(b64);
      const n = bytes.length >> 1;
      if (!n) return;
      const pcm = new Int16Array(n);
      const view = new DataView(bytes.buffer, bytes.byteOffset, n * 2);
      for (let i = 0; i < n; i++) pcm[i] = view.getInt16(i * 2, true);
      this.chunks.push(pcm);
      this.samples += n;
      if (!this.ctx) return;
      try {
        const buf = this.ctx.createBuffer(1, n, SAMPLE_RATE);
        const ch = buf.getChannelData(0);
        for (let i = 0; i < n; i++) ch[i] = pcm[i] / 32768;
        const src = this.ctx.createBufferSource();
        src.buffer = buf;
        src.connect(this.ctx.destination);
        const now = this.ctx.currentTime;
        if (this.next < now + 0.02) this.next = now + 0.05; // start (or restart after a gap)
        src.start(this.next);
        this.next += buf.duration;
      } catch (e) {
        /* playback is best effort; the WAV still gets built */
      }
    }

    wav() {
      const dataBytes = this.samples * 2;
      const out = new DataView(new ArrayBuffer(44 + dataBytes));
      const str = (off, s) => { for (let i = 0; i < s.length; i++) out.setUint8(off + i, s.charCodeAt(i)); };
      str(0, "RIFF"); out.setUint32(4, 36 + dataBytes, true); str(8, "WAVE");
      str(12, "fmt "); out.setUint32(16, 16, true); out.setUint16(20, 1, true); out.setUint16(22, 1, true);
      out.setUint32(24, SAMPLE_RATE, true); out.setUint32(28, SAMPLE_RATE * 2, true);
      out.setUint16(32, 2, true); out.setUint16(34, 16, true);
      str(36, "data"); out.setUint32(40, dataBytes, true);
      let off = 44;
      for (const pcm of this.chunks) {
        for (let i = 0; i < pcm.length; i++, off += 2) out.setInt16(off, pcm[i], true);
      }
      return new Blob([out.buffer], { type: "audio/wav" });
    }

    // The stream ended: close the audio output once what is scheduled has played
    // (closing it at once would cut the last chunks off).
    stop() {
      const ctx = this.ctx;
      this.ctx = null;
      if (!ctx) return;
      const left = Math.max(0, this.next - ctx.currentTime);
      setTimeout(() => ctx.close().catch(() => {}), left * 1000 + 200);
    }
  }

  // --- SSE over fetch ----------------------------------------------------------------

  // Calls onEvent(data) for every `data:` event; returns when the body ends.
  async function readSSE(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    const flush = (block) => {
      const data = block.split(/\r?\n/)
        .filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) return onEvent(data);
      return false;
    };
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let m;
      while ((m = buffer.match(/\r?\n\r?\n/))) {
        const block = buffer.slice(0, m.index);
        buffer = buffer.slice(m.index + m[0].length);
        if (flush(block) === true) { reader.cancel().catch(() => {}); return; }
      }
    }
    buffer += decoder.decode();
    if (buffer.trim()) flush(buffer);
  }

  // --- chat --------------------------------------------------------------------------

  function numberOr(input, fallback) {
    const v = input.value.trim();
    if (v === "") return fallback;
    const n = Number(v);
    return Number.isFinite(n) ? n : fallback;
  }

  async function sendChat() {
    if (busy) return;
    clearError();
    const text = el.prompt.value.trim();
    const imgFile = currentImage();
    const audFile = currentAudio();
    const vidFile = currentVideo();
    if (!text && !imgFile && !audFile && !recorded && !vidFile) {
      showError("Type a message or attach an image, a sound or a video first.");
      return;
    }
    if (!el.model.value) {
      showError("No model to talk to (GET /v1/models gave none).");
      return;
    }
    setBusy(true);
    setStatus("sending", "sending…");

    let image = null;
    let audio = null;
    let video = null;
    try {
      // a clip goes inline, as a data: URL (the server reads no files or remote URLs by default)
      if (vidFile) video = { dataUrl: await readAsDataURL(vidFile), blob: vidFile, name: vidFile.name };
      if (imgFile) image = { dataUrl: await readAsDataURL(imgFile), name: imgFile.name };
      if (audFile) {
        audio = { dataUrl: await readAsDataURL(audFile), blob: audFile, name: audFile.name,
          format: audioFormat(audFile) };
      }
      else if (recorded) audio = { ...recorded, format: "wav" };
    } catch (e) {
      showError(`Could not read the attachment: ${e.message || e}`);
      setStatus("error");
      setBusy(false);
      return;
    }

    const parts = [];
    if (text) parts.push({ type: "text", text });
    if (image) parts.push({ type: "image_url", image_url: { url: image.dataUrl } });
    if (video) parts.push({ type: "video_url", video_url: { url: video.dataUrl } });
    if (audio) {
      parts.push({ type: "input_audio",
        input_audio: { data: audio.dataUrl.slice(audio.dataUrl.indexOf(",") + 1), format: audio.format } });
    }
    const userMsg = { role: "user", content: parts.length === 1 && parts[0].type === "text" ? text : parts };
    renderUser(text, image, audio, video);

    const speak = el.speak.checked;
    const request = {
      model: el.model.value,
      messages: [...history, userMsg],
      stream: true,
      temperature: numberOr(el.temperature, 0.7),
      max_tokens: Math.max(1, Math.round(numberOr(el.maxTokens, 64))),
    };
    const seed = numberOr(el.seed, null);
    if (seed !== null) request.seed = Math.round(seed);
    if (speak) {
      request.modalities = ["text", "audio"];
      request.audio = { voice: el.voice.value, format: "pcm16" };
    }

    // The reply bubble: #reply is the newest assistant text.
    const { wrap, body } = addMessage("assistant");
    wrap.classList.add("streaming");
    const replyText = document.createElement("div");
    replyText.className = "text";
    takeId(replyText, "reply");
    replyText.dataset.deltas = "0";
    body.appendChild(replyText);
    const meta = document.createElement("div");
    meta.className = "meta";
    body.appendChild(meta);

    // Clear the composer now (what was sent is on the page).
    el.prompt.value = "";
    el.imageFile.value = "";
    el.audioFile.value = "";
    el.videoFile.value = "";
    recorded = null;
    renderAttachments();

    const player = speak ? new SpeechPlayer() : null;
    let reply = "";
    let finish = null;
    let streamError = null;
    let sawDone = false;
    const started = performance.now();
    let firstToken = null;
    let firstAudio = null;
    controller = new AbortController();

    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
        body: JSON.stringify(request),
        signal: controller.signal,
      });
      if (!response.ok) throw new Error(await errorMessage(response));
      setStatus("streaming", "streaming…");
      await readSSE(response, (data) => {
        if (data.trim() === "[DONE]") { sawDone = true; return true; }
        let chunk;
        try { chunk = JSON.parse(data); } catch (e) { return false; }
        if (chunk.error) {
          streamError = chunk.error.message || JSON.stringify(chunk.error);
          return true;
        }
        const choice = (chunk.choices || [])[0];
        if (!choice) return false;
        const delta = choice.delta || {};
        let piece = "";
        if (typeof delta.content === "string") piece += delta.content;
        if (delta.audio) {
          if (typeof delta.audio.transcript === "string") piece += delta.audio.transcript;
          if (delta.audio.data && player) {
            if (firstAudio === null) firstAudio = performance.now() - started;
            player.push(delta.audio.data);
          }
        }
        if (piece) {
          if (firstToken === null) firstToken = performance.now() - started;
          reply += piece;
          replyText.textContent = reply;
          replyText.dataset.deltas = String(Number(replyText.dataset.deltas) + 1);
          scrollDown();
        }
        if (choice.finish_reason) finish = choice.finish_reason;
        return false;
      });
      if (streamError) throw new Error(streamError);
      if (!sawDone && !finish) throw new Error("the stream ended before [DONE]");
    } catch (e) {
      if (e.name === "AbortError") {
        finish = "cancelled";
      } else {
        streamError = e.message || String(e);
      }
    } finally {
      controller = null;
      wrap.classList.remove("streaming");
    }

    if (player) {
      player.stop();
      if (player.samples > 0) {
        const a = document.createElement("audio");
        a.controls = true;
        a.src = URL.createObjectURL(player.wav());
        takeId(a, "audio-player");
        body.insertBefore(a, meta);
      }
    }

    const bits = [];
    if (firstToken !== null) bits.push(`first token ${(firstToken / 1000).toFixed(2)} s`);
    if (firstAudio !== null) bits.push(`first audio ${(firstAudio / 1000).toFixed(2)} s`);
    if (player && player.samples) bits.push(`${(player.samples / SAMPLE_RATE).toFixed(2)} s of speech`);
    if (finish) bits.push(`finish: ${finish}`);
    meta.textContent = bits.join(" · ");
    scrollDown();

    // Earlier turns go back as text: only the newest user message may carry media.
    if (reply) history.push({ role: "user", content: text }, { role: "assistant", content: reply });

    if (streamError) {
      if (!reply && !(player && player.samples)) wrap.remove();
      else wrap.classList.add("failed");
      showError(streamError);
      setStatus("error");
    } else {
      setStatus("done");
    }
    setBusy(false);
    el.prompt.focus();
  }

  // --- images ------------------------------------------------------------------------

  async function generateImage() {
    if (busy) return;
    clearError();
    const prompt = el.prompt.value.trim();
    if (!prompt) {
      showError("Type a prompt to draw first.");
      return;
    }
    const size = el.imageSize.value.trim() || "64x64";
    if (!/^\d+x\d+$/.test(size)) {
      showError(`Image size must look like 64x64, not "${size}".`);
      return;
    }
    setBusy(true);
    setStatus("generating", "drawing…");
    renderUser(prompt, null, null);
    el.prompt.value = "";
    const { wrap, body } = addMessage("assistant");
    wrap.classList.add("streaming");
    const request = { prompt, n: 1, size, response_format: "b64_json" };
    if (el.imageModel.value) request.model = el.imageModel.value;
    const seed = numberOr(el.seed, null);
    if (seed !== null) request.seed = Math.round(seed);
    const started = performance.now();
    controller = new AbortController();
    try {
      const response = await fetch("/v1/images/generations", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(request),
        signal: controller.signal,
      });
      if (!response.ok) throw new Error(await errorMessage(response));
      const out = await response.json();
      const item = (out.data || [])[0];
      if (!item || !(item.b64_json || item.url)) throw new Error("the server answered without an image");
      const img = document.createElement("img");
      img.className = "generated";
      img.alt = prompt;
      img.src = item.b64_json ? `data:image/png;base64,${item.b64_json}` : item.url;
      takeId(img, "generated-image");
      body.appendChild(img);
      const meta = document.createElement("div");
      meta.className = "meta";
      meta.textContent = `${size} · ${((performance.now() - started) / 1000).toFixed(2)} s`;
      body.appendChild(meta);
      setStatus("done");
    } catch (e) {
      wrap.classList.add("failed");
      if (e.name === "AbortError") {
        setStatus("done", "cancelled");
      } else {
        showError(e.message || String(e));
        setStatus("error");
      }
    } finally {
      controller = null;
      wrap.classList.remove("streaming");
      setBusy(false);
      scrollDown();
    }
  }

  // --- microphone (WAV through an AudioContext), when the browser allows it -----------

  function setupRecorder() {
    const md = navigator.mediaDevices;
    const Ctx = window.AudioContext || window.webkitAudioContext;
    if (!md || !md.getUserMedia || !Ctx) return; // the file input remains
    el.record.hidden = false;
    let rec = null;
    el.record.addEventListener("click", async () => {
      clearError();
      if (rec) { // stop
        const { ctx, stream, node, source, buffers, rate } = rec;
        rec = null;
        node.disconnect(); source.disconnect();
        stream.getTracks().forEach((t) => t.stop());
        ctx.close().catch(() => {});
        el.record.textContent = "● Record";
        el.record.classList.remove("recording");
        const n = buffers.reduce((s, b) => s + b.length, 0);
        const view = new DataView(new ArrayBuffer(44 + n * 2));
        const str = (off, s) => { for (let i = 0; i < s.length; i++) view.setUint8(off + i, s.charCodeAt(i)); };
        str(0, "RIFF"); view.setUint32(4, 36 + n * 2, true); str(8, "WAVE"); str(12, "fmt ");
        view.setUint32(16, 16, true); view.setUint16(20, 1, true); view.setUint16(22, 1, true);
        view.setUint32(24, rate, true); view.setUint32(28, rate * 2, true); view.setUint16(32, 2, true);
        view.setUint16(34, 16, true); str(36, "data"); view.setUint32(40, n * 2, true);
        let off = 44;
        for (const b of buffers) {
          for (let i = 0; i < b.length; i++, off += 2) {
            view.setInt16(off, Math.max(-1, Math.min(1, b[i])) * 32767, true);
          }
        }
        const blob = new Blob([view.buffer], { type: "audio/wav" });
        recorded = { dataUrl: await readAsDataURL(blob), blob, name: `recording (${(n / rate).toFixed(1)} s).wav` };
        el.audioFile.value = "";
        renderAttachments();
        return;
      }
      try {
        const stream = await md.getUserMedia({ audio: { channelCount: 1 } });
        const ctx = new Ctx();
        const source = ctx.createMediaStreamSource(stream);
        const node = ctx.createScriptProcessor(4096, 1, 1);
        const buffers = [];
        node.onaudioprocess = (ev) => buffers.push(new Float32Array(ev.inputBuffer.getChannelData(0)));
        source.connect(node);
        node.connect(ctx.destination);
        rec = { ctx, stream, node, source, buffers, rate: ctx.sampleRate };
        el.record.textContent = "■ Stop recording";
        el.record.classList.add("recording");
      } catch (e) {
        showError(`Microphone unavailable: ${e.message || e}`);
      }
    });
  }

  // --- voice mode: a /v1/realtime conversation (microphone in, speech out) -----------
  // The microphone streams as input_audio_buffer.append (PCM16, 24 kHz) with server VAD on;
  // the reply's speech plays as it arrives and stops when the server hears the user again
  // (input_audio_buffer.speech_started: barge-in).

  function pcm16Base64(samples) {
    const bytes = new Uint8Array(samples.length * 2);
    const view = new DataView(bytes.buffer);
    for (let i = 0; i < samples.length; i++) {
      view.setInt16(i * 2, Math.round(Math.max(-1, Math.min(1, samples[i])) * 32767), true);
    }
    let s = "";
    for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    return btoa(s);
  }

  class VoiceSession {
    constructor(model, onEnd) {
      this.model = model;
      this.onEnd = onEnd;
      this.ws = null;
      this.ctx = null;
      this.stream = null;
      this.ready = false; // session.updated seen: server VAD is on
      this.pending = []; // microphone frames captured before that
      this.sources = new Set(); // reply audio scheduled or playing
      this.next = 0;
      this.reply = null; // {id, wrap, text, meta, samples} of the response being received
      this.cut = new Set(); // responses interrupted here: their late deltas are dropped
      this.heard = null; // {wrap, from}: the user bubble of the speech being heard
      this.closed = false;
    }

    async start() {
      const Ctx = window.AudioContext || window.webkitAudioContext;
      const md = navigator.mediaDevices;
      if (!Ctx || !md || !md.getUserMedia) throw new Error("this browser gives no microphone here (it needs https or localhost)");
      this.stream = await md.getUserMedia({
        audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
      });
      if (this.closed) { this.release(); return; } // ended while the browser asked
      this.ctx = new Ctx({ sampleRate: SAMPLE_RATE });
      if (this.ctx.state === "suspended") await this.ctx.resume().catch(() => {});
      const source = this.ctx.createMediaStreamSource(this.stream);
      if (this.ctx.audioWorklet) {
        await this.ctx.audioWorklet.addModule("/static/voice-capture.js");
        if (this.closed) { this.release(); return; }
        this.node = new AudioWorkletNode(this.ctx, "voice-capture");
        this.node.port.onmessage = (ev) => this.capture(ev.data);
      } else {
        this.node = this.ctx.createScriptProcessor(2048, 1, 1);
        this.node.onaudioprocess = (ev) => this.capture(new Float32Array(ev.inputBuffer.getChannelData(0)));
      }
      source.connect(this.node);
      this.node.connect(this.ctx.destination); // (silent) keeps the node pulled

      const scheme = location.protocol === "https:" ? "wss" : "ws";
      this.ws = new WebSocket(`${scheme}://${location.host}/v1/realtime?model=${encodeURIComponent(this.model)}`);
      this.ws.onopen = () => this.send({ type: "session.update", session: this.settings() });
      this.ws.onmessage = (ev) => {
        let event;
        try { event = JSON.parse(ev.data); } catch (e) { return; }
        this.receive(event);
      };
      this.ws.onclose = (ev) => this.stop(ev.code === 1000 || ev.code === 1005 ? "" : `voice session closed: ${ev.reason || ev.code}`);
    }

    settings() {
      const session = {
        type: "realtime",
        output_modalities: ["audio"],
        audio: {
          input: { format: { type: "audio/pcm", rate: SAMPLE_RATE }, turn_detection: { type: "server_vad" } },
          output: { format: { type: "audio/pcm", rate: SAMPLE_RATE }, voice: el.voice.value },
        },
        max_output_tokens: Math.max(1, Math.round(numberOr(el.maxTokens, 64))),
      };
      const seed = numberOr(el.seed, null);
      if (seed !== null) session.seed = Math.round(seed);
      return session;
    }

    send(event) {
      if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(event));
    }

    capture(frame) {
      if (this.closed) return;
      if (!this.ready) { this.pending.push(frame); return; }
      this.send({ type: "input_audio_buffer.append", audio: pcm16Base64(frame) });
    }

    receive(event) {
      switch (event.type) {
        case "session.updated":
          if (!this.ready) {
            this.ready = true;
            for (const frame of this.pending.splice(0)) this.capture(frame);
            setStatus("listening", "listening…");
          }
          break;
        case "input_audio_buffer.speech_started":
          this.interrupt();
          this.heard = { wrap: renderUser("🎤 …", null, null), from: event.audio_start_ms };
          setStatus("hearing", "hearing you…");
          break;
        case "input_audio_buffer.speech_stopped":
          if (this.heard) {
            const s = ((event.audio_end_ms - this.heard.from) / 1000).toFixed(1);
            this.heard.wrap.querySelector(".text").textContent = `🎤 spoken (${s} s)`;
            this.heard = null;
          }
          break;
        case "response.created":
          this.newReply(event.response && event.response.id);
          setStatus("streaming", "answering…");
          break;
        case "response.output_audio_transcript.delta":
        case "response.output_text.delta":
          if (this.cut.has(event.response_id)) break;
          if (!this.reply) this.newReply(event.response_id);
          this.reply.text.textContent += event.delta;
          scrollDown();
          break;
        case "response.output_audio.delta":
          if (this.cut.has(event.response_id)) break;
          if (!this.reply) this.newReply(event.response_id);
          this.play(event.delta);
          break;
        case "response.done":
          if (this.reply && !this.cut.has(event.response && event.response.id)) this.finishReply(event.response);
          setStatus("listening", "listening…");
          break;
        case "error":
          showError((event.error && event.error.message) || "realtime error");
          break;
        default:
          break;
      }
    }

    newReply(id) {
      const { wrap, body } = addMessage("assistant");
      wrap.classList.add("streaming");
      const text = document.createElement("div");
      text.className = "text";
      takeId(text, "voice-reply");
      const meta = document.createElement("div");
      meta.className = "meta";
      body.append(text, meta);
      this.reply = { id, wrap, text, meta, samples: 0 };
      scrollDown();
    }

    finishReply(response) {
      if (!this.reply) return;
      const { wrap, meta, samples } = this.reply;
      wrap.classList.remove("streaming");
      const bits = [];
      if (samples) bits.push(`${(samples / SAMPLE_RATE).toFixed(2)} s of speech`);
      if (response.status) bits.push(response.status);
      meta.textContent = bits.join(" · ");
      this.reply = null;
    }

    play(b64) {
      const bytes = base64ToBytes(b64);
      const n = bytes.length >> 1;
      if (!n || !this.ctx) return;
      const view = new DataView(bytes.buffer, bytes.byteOffset, n * 2);
      const buf = this.ctx.createBuffer(1, n, SAMPLE_RATE);
      const ch = buf.getChannelData(0);
      for (let i = 0; i < n; i++) ch[i] = view.getInt16(i * 2, true) / 32768;
      const src = this.ctx.createBufferSource();
      src.buffer = buf;
      src.connect(this.ctx.destination);
      const now = this.ctx.currentTime;
      if (this.next < now + 0.02) this.next = now + 0.05;
      src.start(this.next);
      this.next += buf.duration;
      this.sources.add(src);
      src.onended = () => this.sources.delete(src);
      this.reply.samples += n;
    }

    // Barge-in: the user talks over the reply, so its speech stops here at once.
    interrupt() {
      for (const src of this.sources) {
        try { src.stop(); } catch (e) { /* not started yet */ }
      }
      this.sources.clear();
      this.next = 0;
      if (this.reply) {
        this.cut.add(this.reply.id);
        this.reply.wrap.classList.add("interrupted");
        this.finishReply({ status: "interrupted" });
      }
    }

    stop(message) {
      if (this.closed) return;
      this.closed = true;
      this.interrupt();
      this.release();
      this.onEnd(message || "");
    }

    release() {
      if (this.ws && this.ws.readyState <= WebSocket.OPEN) this.ws.close(1000);
      if (this.stream) this.stream.getTracks().forEach((t) => t.stop());
      if (this.ctx && this.ctx.state !== "closed") this.ctx.close().catch(() => {});
    }
  }

  function setupVoice() {
    let session = null;
    const off = (message) => {
      session = null;
      el.voiceMode.setAttribute("aria-pressed", "false");
      el.voiceMode.classList.remove("recording");
      el.voiceMode.textContent = "🎙 Voice";
      if (message) { showError(message); setStatus("error"); } else setStatus("idle");
    };
    el.voiceMode.addEventListener("click", async () => {
      clearError();
      if (session) { session.stop(""); return; }
      if (!el.model.value) { showError("No model to talk to (GET /v1/models gave none)."); return; }
      session = new VoiceSession(el.model.value, off);
      el.voiceMode.setAttribute("aria-pressed", "true");
      el.voiceMode.classList.add("recording");
      el.voiceMode.textContent = "■ End voice";
      setStatus("sending", "connecting…");
      try {
        await session.start();
      } catch (e) {
        session.stop(`Voice mode unavailable: ${e.message || e}`);
      }
    });
  }

  // --- models ------------------------------------------------------------------------

  async function loadModels() {
    try {
      const response = await fetch("/v1/models");
      if (!response.ok) throw new Error(await errorMessage(response));
      const body = await response.json();
      const models = body.data || [];
      // `kind` (omni / llm / image) is this server's extension; without it, offer everything.
      const chat = models.filter((m) => !m.kind || m.kind === "omni" || m.kind === "llm").map((m) => m.id);
      const draw = models.filter((m) => m.kind === "image" || (!m.kind && /image/.test(m.id))).map((m) => m.id);
      el.model.textContent = "";
      for (const id of chat) el.model.appendChild(new Option(id, id));
      if (!chat.length) el.model.appendChild(new Option("(no chat models)", ""));
      if (chat.includes("omni")) el.model.value = "omni";
      el.imageModel.textContent = "";
      for (const id of draw) el.imageModel.appendChild(new Option(id, id));
      if (!draw.length) el.imageModel.appendChild(new Option("(server default)", ""));
      el.model.dataset.loaded = "true";
    } catch (e) {
      el.model.textContent = "";
      el.model.appendChild(new Option("(unavailable)", ""));
      showError(`Could not list the models: ${e.message || e}`);
    }
  }

  // --- wiring ------------------------------------------------------------------------

  el.composer.addEventListener("submit", (ev) => { ev.preventDefault(); sendChat(); });
  el.genImage.addEventListener("click", generateImage);
  el.prompt.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      sendChat();
    }
  });
  el.stop.addEventListener("click", () => { if (controller) controller.abort(); });
  el.clear.addEventListener("click", () => {
    if (busy) return;
    history.length = 0;
    el.messages.textContent = "";
    clearError();
    setStatus("idle");
  });

  setupRecorder();
  setupVoice();
  loadModels();
})();
